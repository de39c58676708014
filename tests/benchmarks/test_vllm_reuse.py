"""The vLLM reuse benchmark's own logic (no engine: runs in the main venv)."""
import json
import os
import subprocess
import sys


def test_default_model_resolves_after_the_convert_submodule_is_imported(tmp_path):
    """``--quick`` without ``--model`` converted the bundled model through ``from kvz.integrations.vllm
    import convert``, which is the *submodule* once anything imported it: ``TypeError: 'module' object
    is not callable``. An already-converted directory (its marker present) is used as it is."""
    model = tmp_path / ".cache" / "kvz" / "gemma3-hf"
    model.mkdir(parents=True)
    (model / "KVZ_SOURCE.json").write_text(json.dumps({"source": "test"}))
    code = ("import kvz.integrations.vllm.convert\n"
            "from kvz.benchmarks.vllm_reuse import resolve_model\n"
            "print(resolve_model(None))\n")
    env = dict(os.environ, HOME=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=str(tmp_path),
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(model.resolve())


def test_given_model_is_kept():
    from kvz.benchmarks.vllm_reuse import resolve_model

    assert resolve_model("/some/dir") == "/some/dir"
