"""Rate: how many bits for which error or downstream quality.

:mod:`.acceptance` (bpv at a target error, per scope), :mod:`.eps_table` (what each eps costs and
changes in the model's next tokens), :mod:`.lossless` (two-tier files against zstd and pcodec),
:mod:`.calibration_size` (how much calibration text a bank needs), :mod:`.sensitivity` (the
per-tensor KL weights of the weighted scope), :mod:`.attention_gain` (what an attention-aware
measure could save), :mod:`.second_model` (the scopes on SmolLM2-135M)."""
