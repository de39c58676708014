"""The loader benchmark's command line refuses counts below one with a usage error."""
import pytest


@pytest.mark.parametrize("flag", ["--threads", "--repeats", "--chunk"])
def test_counts_below_one_are_usage_errors(flag, capsys):
    from benchmarks.studies.speed import loader

    with pytest.raises(SystemExit) as e:
        loader.main([flag, "0"])
    assert e.value.code == 2 and "must be >= 1" in capsys.readouterr().err
