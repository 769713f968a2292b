"""The launcher refuses, at start-up, a job whose flags need a package that is not installed:
``--save`` with the default ``torch_dist`` checkpoint format needs psutil (without it megatron-core's
writer processes fail and the job hangs at its first save)."""

import argparse

import pytest

from megatron_slim.megatron.launch.package_checks import check_installed_packages
from megatron_slim.plan.schema import ConfigError


def _args(**kwargs):
    return argparse.Namespace(**{"save": None, "ckpt_format": "torch_dist", **kwargs})


def _without(missing):
    return lambda name: name != missing


def test_save_in_torch_dist_without_psutil_is_refused_naming_the_package():
    with pytest.raises(ConfigError) as refused:
        check_installed_packages(_args(save="/ckpt"), installed=_without("psutil"))
    message = str(refused.value)
    assert "--save /ckpt with --ckpt-format torch_dist" in message and "psutil" in message
    assert "allowed: pip install psutil" in message and "--ckpt-format torch" in message


@pytest.mark.parametrize("args", [_args(), _args(save="/ckpt", ckpt_format="torch")], ids=["no-save", "torch-format"])
def test_jobs_that_never_use_the_async_writer_start_without_psutil(args):
    check_installed_packages(args, installed=_without("psutil"))


def test_with_psutil_installed_a_saving_job_starts():
    check_installed_packages(_args(save="/ckpt"), installed=lambda name: True)
