"""ltcx/study/stats.py against the formulas written out: Student's t quantiles and the t-distribution's CDF for
2 degrees of freedom in closed form (F(t) = 1/2 + t / (2 sqrt(2 + t^2))), a table value for 4, and scipy's paired
t-test."""

import math

import pytest

from ltcx.study.stats import mean_interval, paired_difference

pytestmark = pytest.mark.quick

T_975 = {2: 4.302652729749464, 4: 2.7764451051977987}  # t_{0.975, df}: the tables' 4.303 and 2.776


def test_interval_of_three_seeds_is_the_t_formula():
    values = [4.10, 4.05, 4.07]
    mean = sum(values) / 3
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / 2)
    interval = mean_interval(values)
    assert interval.mean == pytest.approx(mean, rel=1e-15) and interval.sd == pytest.approx(sd, rel=1e-14)
    assert interval.half_width == pytest.approx(T_975[2] * sd / math.sqrt(3), rel=1e-9)
    assert interval.low < mean < interval.high and interval.n == 3


def test_five_values_use_four_degrees_of_freedom():
    values = [1.0, 2.0, 4.0, 8.0, 16.0]
    sd = math.sqrt(sum((v - 6.2) ** 2 for v in values) / 4)
    assert mean_interval(values).half_width == pytest.approx(T_975[4] * sd / math.sqrt(5), rel=1e-9)


def test_one_value_has_no_interval():
    interval = mean_interval([3.5])
    assert (interval.mean, interval.half_width, interval.sd, interval.low) == (3.5, None, None, None)
    with pytest.raises(ValueError, match="at least one"):
        mean_interval([])


def test_paired_difference_p_value_is_the_closed_form_for_three_pairs():
    model, baseline = [4.07, 4.06, 4.09], [4.13, 4.14, 4.12]
    differences = [a - b for a, b in zip(model, baseline)]
    mean = sum(differences) / 3
    sd = math.sqrt(sum((d - mean) ** 2 for d in differences) / 2)
    statistic = mean / (sd / math.sqrt(3))
    p = 1 - abs(statistic) / math.sqrt(2 + statistic**2)  # 2 (1 - F(|t|)) for 2 degrees of freedom
    result = paired_difference(model, baseline)
    assert result.interval.mean == pytest.approx(mean, rel=1e-12)
    assert result.interval.half_width == pytest.approx(T_975[2] * sd / math.sqrt(3), rel=1e-9)
    assert result.p_value == pytest.approx(p, rel=1e-9)


def test_paired_difference_equals_scipys_paired_t_test():
    from scipy.stats import ttest_rel

    model, baseline = [0.31, 0.29, 0.35, 0.30, 0.33], [0.30, 0.30, 0.31, 0.28, 0.30]
    assert paired_difference(model, baseline).p_value == pytest.approx(ttest_rel(model, baseline).pvalue, rel=1e-12)


def test_paired_difference_without_spread_or_pairs():
    assert paired_difference([1.0, 2.0], [0.5, 1.5]).p_value is None  # the same gap every seed: sd 0
    assert paired_difference([1.0], [0.5]).p_value is None
    with pytest.raises(ValueError, match="pairs"):
        paired_difference([1.0, 2.0], [1.0])
