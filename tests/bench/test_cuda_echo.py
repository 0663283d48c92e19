"""The CUDA echo bench (benchmarks/cuda_echo.py): without a GPU it says so and measures
nothing; on one, gpu_check.sh runs it (its harness can be tried without a GPU with
``--cpu-dry-run``)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import cuda_echo


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU here: gpu_check.sh measures")
def test_without_a_gpu_the_cuda_echo_measures_nothing_and_says_so(capsys, tmp_path):
    out = tmp_path / "echo.json"
    assert cuda_echo.main(["--json-out", str(out)]) == 0
    assert "no CUDA device here; nothing measured" in capsys.readouterr().out
    assert not out.exists()
