import statistics

import pytest

from megatron_slim.plan.cp.lengths import make_packs, parse_lengths
from megatron_slim.plan.schema import ConfigError


def draws(spec: str, n: int, seed: int = 0) -> list[int]:
    stream = parse_lengths(spec).stream(seed)
    return [next(stream) for _ in range(n)]


def test_lognormal_mean_is_the_untruncated_mean_and_draws_stay_in_the_window():
    wide = draws("lognormal:mean=8192,sigma=0.5,min=1,max=100000000", 20000)
    assert abs(statistics.fmean(wide) / 8192 - 1) < 0.03
    narrow = draws("lognormal: mean=8192, sigma=1.1, min=1024, max=65536", 5000)
    assert min(narrow) >= 1024 and max(narrow) <= 65536
    assert min(narrow) < 1200 and max(narrow) > 50000  # truncated, not clipped to a spike
    assert narrow.count(1024) < 20 and narrow.count(65536) < 20


def test_uniform_fixed_and_mix():
    u = draws("uniform:min=10,max=20", 2000)
    assert set(u) == set(range(10, 21))
    assert draws("fixed:length=77", 5) == [77] * 5
    m = draws("mix:0.75*fixed(length=1)+0.25*uniform(min=1000,max=2000)", 4000)
    share = sum(1 for x in m if x == 1) / len(m)
    assert abs(share - 0.75) < 0.03 and all(x == 1 or 1000 <= x <= 2000 for x in m)


def test_seed_determines_the_draws():
    spec = "lognormal:mean=4096,sigma=1.2,min=256,max=65536"
    assert draws(spec, 50, 1) == draws(spec, 50, 1)
    assert draws(spec, 50, 1) != draws(spec, 50, 2)


def test_file_lengths_are_used_in_order_and_cycled(tmp_path):
    path = tmp_path / "lengths.txt"
    path.write_text("# lengths\n5\n\n7  # seven\n3\n")
    assert draws(str(path), 7) == [5, 7, 3, 5, 7, 3, 5]
    assert draws(str(path), 4, seed=1) == draws(str(path), 4, seed=2)


@pytest.mark.parametrize(
    "spec,needle",
    [
        ("gauss:mean=1", "--lengths kind: invalid value (got 'gauss'"),
        ("lognormal:mean=8192,sigma=1.1,min=1024", "lognormal.max: missing key"),
        ("lognormal:mean=8192,sigma=0,min=1,max=9", "lognormal.sigma: invalid value (got 0.0; allowed: a number > 0)"),
        ("lognormal:mean=8192,sigma=1,min=1,max=9,mu=3", "keys mean, sigma, min, max"),
        ("uniform:min=10,max=5", "uniform.max: invalid value (got 5.0; allowed: an integer >= min=10)"),
        ("uniform:min=0.5,max=5", "uniform.min: invalid value"),
        ("fixed:length=abc", "fixed.length: invalid value (got 'abc'; allowed: a finite number)"),
        (
            "lognormal:mean=nan,sigma=1,min=1,max=9",
            "lognormal.mean: invalid value (got 'nan'; allowed: a finite number)",
        ),
        (
            "lognormal:mean=8,sigma=inf,min=1,max=9",
            "lognormal.sigma: invalid value (got 'inf'; allowed: a finite number)",
        ),
        ("uniform:min=1,max=-inf", "uniform.max: invalid value (got '-inf'; allowed: a finite number)"),
        ("mix:1e999*fixed(length=3)", "mix[0].weight: invalid value (got '1e999'; allowed: a finite number > 0)"),
        ("mix:0.5*fixed(length=3)+uniform(min=1,max=2)", "--lengths mix[1]"),
        ("mix:-1*fixed(length=3)", "mix[0].weight"),
        ("nonsense", "not an existing file or a spec"),
        ("", "not an existing file or a spec"),
    ],
)
def test_spec_errors_name_the_field_and_the_allowed_values(spec, needle):
    with pytest.raises(ConfigError) as exc:
        parse_lengths(spec)
    assert needle in str(exc.value)


def test_bad_file_line_is_named(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_text("12\n-4\n")
    with pytest.raises(ConfigError, match=r"bad.txt:2: invalid value \(got '-4'"):
        parse_lengths(str(path))


def test_impossible_lognormal_window_fails_instead_of_looping():
    with pytest.raises(ConfigError, match="almost none"):
        draws("lognormal:mean=100,sigma=0.1,min=100000,max=100001", 1)


@pytest.mark.parametrize(
    "spec",
    [
        "lognormal:mean=8192,sigma=1.1,min=1024,max=65536",
        "uniform:min=1,max=9000",
        "mix:0.9*uniform(min=100,max=4000)+0.1*uniform(min=50000,max=300000)",
    ],
)
def test_every_pack_is_exactly_full_and_sequences_fit(spec):
    packs = make_packs(parse_lengths(spec), 65536, 6, seed=3)
    assert len(packs) == 6
    for pack in packs:
        assert sum(pack) == 65536 and all(1 <= s <= 65536 for s in pack)
    assert packs == make_packs(parse_lengths(spec), 65536, 6, seed=3)
    assert packs != make_packs(parse_lengths(spec), 65536, 6, seed=4)


def test_first_fit_then_one_truncated_filler_per_gap():
    # 300-token sequences into 1000-token packs: three fit, the fourth fills the 100-token gap
    assert make_packs(parse_lengths("fixed:length=300"), 1000, 1) == ((300, 300, 300, 100),)
    # two packs: the seventh draw fills pack 0's gap, pack 1's gap needs one more draw
    assert make_packs(parse_lengths("fixed:length=300"), 1000, 2) == ((300, 300, 300, 100), (300, 300, 300, 100))
    # longer than the pack: truncated to the pack
    assert make_packs(parse_lengths("fixed:length=5000"), 1000, 2) == ((1000,), (1000,))


def test_first_fit_in_draw_order(tmp_path):
    path = tmp_path / "l.txt"
    path.write_text("6\n6\n3\n5\n")
    # draws 6,6,3 (total 15 >= 2*7): 6 -> p0, 6 -> p1, 3 set aside; gaps of 1 filled by its head
    assert make_packs(parse_lengths(str(path)), 7, 2) == ((6, 1), (6, 1))
