from pathlib import Path

import pytest

from megatron_slim.plan.cost.calibration import Calibration, Measurement, load_calibration
from megatron_slim.plan.cost.layer import causal_pairs
from megatron_slim.plan.cost.model import CostModel
from megatron_slim.plan.recipe import load_recipe
from megatron_slim.plan.schema import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_gemm_flops_match_six_n_d_for_short_sequences():
    r = load_recipe("llama2-7b-64k", ["parallel.tp=1", "parallel.sequence_parallel=false"])
    cm = CostModel(r)
    tokens = 1024
    per_layer_params = cm.shape.layer_params() - 2 * r.model.hidden_size
    fwd = cm.shape.forward_work(tokens, 0)
    bwd = cm.shape.backward_work(tokens, 0)
    assert (fwd.gemm_flops + bwd.gemm_flops) == pytest.approx(6 * per_layer_params * tokens, rel=1e-9)


def test_attention_work_depends_on_prefix_under_the_causal_mask():
    cm = CostModel(load_recipe("llama2-7b-64k"))
    early, late = cm.shape.forward_work(8192, 0), cm.shape.forward_work(8192, 57344)
    assert late.attention_flops / early.attention_flops == pytest.approx(
        causal_pairs(8192, 57344) / causal_pairs(8192, 0)
    )
    assert late.gemm_flops == early.gemm_flops
    assert cm.forward_time(1, 8192, 57344) > cm.forward_time(1, 8192, 0)


def test_activation_bytes_by_hand():
    r = load_recipe("llama2-7b-64k")  # tp4 with SP, bf16
    cm = CostModel(r)
    s, h, f, tp = 65536, 4096, 11008, 4
    expected = s * 2 * (4 * h / tp + 2 * h / tp + 3 * f / tp) + s * (32 / tp) * 4
    assert cm.shape.activation_bytes(s) == pytest.approx(expected)
    assert cm.shape.kv_bytes(s) == pytest.approx(2 * s * 32 * 128 / tp * 2)
    assert cm.shape.kv_grad_bytes(s) == pytest.approx(2 * cm.shape.kv_bytes(s))  # fp32 buffers
    assert cm.activation_bytes(3, s) > cm.activation_bytes(0, s)  # output layer on the last stage
    assert (
        CostModel(load_recipe("llama2-7b-64k", ["train.recompute=full"])).activation_bytes(0, s)
        < cm.activation_bytes(0, s) / 10
    )


def test_static_memory_is_weights_grads_and_sharded_adam():
    r = load_recipe("llama2-7b-64k")
    cm = CostModel(r)
    params = cm.rank_params(1)
    assert cm.static_bytes(1) == pytest.approx(params * (2 + 4 + 12 / 4))
    assert cm.rank_params(0) > params and cm.rank_params(3) > params


def test_pipeline_links_cross_nodes_when_stages_are_far_apart():
    cm = CostModel(load_recipe("llama2-7b-64k"))  # tp4 x dp4 = 16 GPUs per stage: stages on other nodes
    assert not cm.pp_link(0, 1).intra_node
    cm1 = CostModel(load_recipe("llama2-7b-64k", ["parallel.dp=1", "train.global_batch_size=16"]))
    assert cm1.pp_link(0, 1).intra_node


def test_calibration_interpolates_in_log_work_and_overrides_the_profile(tmp_path):
    cal = Calibration("h100", (Measurement("gemm", 1e9, 1e9 / 1e14), Measurement("gemm", 1e12, 1e12 / 6e14)))
    assert cal.rate("gemm", 1e8) == pytest.approx(1e14)
    assert cal.rate("gemm", 1e13) == pytest.approx(6e14)
    assert cal.rate("gemm", 10**10.5) == pytest.approx(3.5e14)
    assert cal.rate("attention_forward", 1e9) is None
    r = load_recipe("llama2-7b-64k")
    slow = Calibration("h100", (Measurement("gemm", 1.0, 1.0 / 1e12),))
    assert CostModel(r, calibration=slow).forward_time(1, 4096, 0) > 10 * CostModel(r).forward_time(1, 4096, 0)
    path = tmp_path / "cal.yaml"
    path.write_text("hardware: h100\nsource: test\nmeasurements:\n  - {op: gemm, work: 1.0e9, seconds: 1.0e-5}\n")
    assert load_calibration(path).rate("gemm", 1e9) == pytest.approx(1e14)
    path.write_text("hardware: h100\nmeasurements:\n  - {op: conv, work: 1.0, seconds: 1.0}\n")
    with pytest.raises(ConfigError, match="op: invalid value .*'gemm'"):
        load_calibration(path)


def test_optimizer_time_reads_the_memory_bound_rate_at_the_bytes_adam_moves():
    """A calibration's small memory-bound points are launch-bound; Adam streams gigabytes."""
    r = load_recipe("llama2-7b-64k")
    slow_small, fast_large = Measurement("memory_bound", 1e3, 1e3 / 1e10), Measurement("memory_bound", 1e6, 1e6 / 2e12)
    cal = Calibration("h100", (slow_small, fast_large))
    cm = CostModel(r, calibration=cal)
    nbytes = cm.rank_params(1) / (r.parallel.dp * r.parallel.cp) * 36
    assert nbytes > 1e6
    assert cm.optimizer_time(1) == pytest.approx(nbytes / 2e12)
    assert CostModel(r).optimizer_time(1) == pytest.approx(nbytes / (3.35e12 * 0.80))  # h100 profile


def test_shipped_hopper_calibrations_load_by_name_and_hold_measured_rates():
    """The measured H200 files (benchmarks/results/gpu_calibration_h200.md): GEMMs at 65-90% of the
    989 TFLOP/s bf16 peak at large sizes, cuDNN attention faster than torch's flash kernel; the
    memory-bound points are the H100's (the H200's HBM is faster), byte for byte its raw file's."""
    from megatron_slim.plan.cost.calibration import shipped_calibrations

    assert {"hopper-cudnn", "hopper-sdpa"} <= set(shipped_calibrations())
    cudnn, sdpa = load_calibration("hopper-cudnn"), load_calibration("hopper-sdpa")
    h100 = load_calibration(ROOT / "benchmarks/results/gpu_measure_h100/calibration-sdpa.yaml").measurements
    for cal in (cudnn, sdpa):
        assert 0.65 < cal.rate("gemm", 1e13) / 989.4e12 < 0.9
        assert cal.rate("memory_bound", 1e10) == pytest.approx(6442450944 / 0.0020961599349975588)
        assert 0.9 < cal.rate("memory_bound", 1e10) / 3.35e12 < 0.93  # H100 HBM3 spec: 3.35 TB/s
        assert cal.rate("memory_bound", 1e6) < 0.5 * cal.rate("memory_bound", 1e10)  # launch-bound
        points = [m for m in cal.measurements if m.op == "memory_bound"]
        assert [(m.work, m.seconds) for m in points] == [(m.work, m.seconds) for m in h100 if m.op == "memory_bound"]
    for op in ("attention_forward", "attention_backward"):
        assert cudnn.rate(op, 1e13) > 1.3 * sdpa.rate(op, 1e13)
        assert cudnn.rate(op, 1e8) < 0.1 * cudnn.rate(op, 1e13)  # small blocks: launch-bound


def test_an_unknown_calibration_name_lists_the_shipped_ones():
    with pytest.raises(ConfigError, match=r"--calibration hopper-nope: no shipped calibration.*hopper-cudnn"):
        load_calibration("hopper-nope")
