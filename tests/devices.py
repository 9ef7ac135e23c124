"""The devices the model tests run on: CPU always; a GPU only under `pytest -m gpu`, where one exists."""

import pytest
import torch

HAS_GPU = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="needs a GPU")])]
