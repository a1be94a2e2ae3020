"""torch's DistributedDataParallel over models with SparseTensor parameters, in 2 processes (gloo): each rank on its
half of every batch ends with the weights of one process trained on the whole batch, equal on both ranks
(``ddp_worker.py`` holds the checks); and the single-process parts of ``scorch.nn.distributed``."""
import pathlib

import pytest
import torch

import scorch
from conftest import run_torchrun

WORKER = str(pathlib.Path(__file__).with_name("ddp_worker.py"))


def _launch(optimizers, timeout=120):
    done = run_torchrun(WORKER, optimizers, timeout=timeout)
    assert done.returncode == 0 and "OK 0" in done.stdout and "OK 1" in done.stdout, done.stdout + done.stderr[-6000:]


def test_ddp_sparse_linear_adam_matches_one_process():
    """Adam and SGD with momentum, plus no_sync, a comm hook with gradient_as_bucket_view, and ranks that start with
    different patterns and numbers of stored entries."""
    _launch("adam,sgd")


@pytest.mark.slow
def test_ddp_every_optimizer_matches_one_process():
    _launch("adam,sgd,adamw,rmsprop,nadam,radam,asgd,adagrad,adamax,adadelta,rprop", timeout=300)


def test_ddp_patch_is_installed_in_torch_class():
    from torch.nn.parallel import DistributedDataParallel
    assert getattr(DistributedDataParallel, "_scorch_sparse", False)


def test_exchange_rows_checks_its_splits():
    with pytest.raises(ValueError, match="send_splits add up to"):
        scorch.nn.distributed.exchange_rows(torch.zeros(3, 2), [1, 1], [2, 1])
    with pytest.raises(ValueError, match="non-negative"):
        scorch.nn.distributed.exchange_rows(torch.zeros(2, 2), [3, -1], [2, 0])


def test_broadcast_sparse_takes_sparse_tensors_only():
    with pytest.raises(TypeError, match="SparseTensors"):
        scorch.nn.distributed.broadcast_sparse([torch.zeros(3)])
