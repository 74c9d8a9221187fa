"""The communication benchmark runs and reports consistent figures (a smoke test, not a timing test)."""
import json

from admm_dist.bench import comm as bench


def test_bench_comm_smoke(tmp_path):
    out = tmp_path / "bench.json"
    assert bench.main(["--quick", "--sizes", "1", "--nprocs", "2", "--json", str(out)]) == 0
    records = json.loads(out.read_text())
    methods = {r["method"] for r in records}
    assert {"ring", "all_reduce", "gossip"} <= methods
    for r in records:
        for key in ("n", "mib", "method", "median_s", "meter_bytes_per_rank",
                    "wire_bytes_per_rank", "analytic_bytes_per_rank"):
            assert key in r, key
        assert r["n"] == 2 and r["mib"] == 1 and r["median_s"] > 0
        # the meter counts exactly the analytic payload
        assert r["meter_bytes_per_rank"] == r["analytic_bytes_per_rank"] == 1 << 20
