"""benchmarks.spot_cost's catch probabilities: the per-step formula against liars counted with the job's own
sampling (``verify.sampled``). The job runs themselves are the benchmark (``python -m benchmarks.spot_cost``)."""

import pytest

from benchmarks.spot_cost import catch_empirical, catch_table


def test_the_catch_formula_matches_liars_counted_with_the_jobs_sampling() -> None:
    table = {(r["f"], r["K"]): r["p_catch"] for r in catch_table([0.0, 0.05], 4)}
    assert table[1.0, 1] == pytest.approx(1 - 0.95**4)
    assert table[0.5, 10] == pytest.approx(1 - 0.95**20)
    counted = catch_empirical([0.05], 4, trials=500, seed=1)
    assert len(counted) == len(table)
    for r in counted:
        assert r["caught"] == pytest.approx(r["formula"], abs=0.08), r
    # lying on more micro-batches is caught sooner
    by = {(r["f"], r["K"]): r["caught"] for r in counted}
    assert by[0.25, 10] < by[1.0, 10]
