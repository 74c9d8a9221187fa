"""The bandwidth-limited links benchmark: its settings and table (fast), and a real run of 2
ranks in two namespaces on a bridge, shaped to 100 Mbit/s, against the unshaped loopback (slow:
root, iproute2, nsenter)."""
import json

import pytest

from benchmarks import links


def test_rates_and_bursts_follow_tc_and_hold_whole_frames():
    assert links.rate_bits("100mbit") == 1e8 and links.rate_bits("1gbit") == 1e9
    assert links.burst_bytes("100mbit") == 125_000 and links.burst_bytes("1gbit") == 1_250_000
    assert links.burst_bytes("1mbit") == 64 * 1024 >= links.MTU
    with pytest.raises(links.LinksError, match="write it as tc does"):
        links.rate_bits("fast")


def test_bad_lists_are_one_line_and_exit_2(capsys):
    assert links.main(["--modes", "ring,allgather"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "coordinator, ring, gossip, decentralized" in err[0]


def test_the_table_puts_every_n_side_by_side_with_each_cells_wire_time():
    recs = [dict(rate="100mbit", mib=1.0, mode="ring", compress=c, n=n, seconds=s, sent=b, recv=b, analytic=b)
            for c, n, s, b in (("none", 2, 0.09, 2**20), ("int8", 2, 0.03, 2**18), ("none", 4, 0.14, 1.5 * 2**20))]
    for r in recs:
        r["wire_s"] = links.wire_seconds(r, "100mbit")
    assert recs[0]["wire_s"] == pytest.approx(2**20 * 8 / 1e8)
    result = {"settings": dict(nodes=[2, 4], rates=["100mbit"], sizes_mib=[1.0], modes=["ring"],
                               compress=["none", "int8"], mtu=1500), "records": recs, "wall_s": 3.0, "load": "x"}
    text = links.format_table(result)
    row = next(line for line in text.splitlines() if "ring-int8" in line)
    assert "0.030 /  0.021 (   0.2 MiB)" in row and row.rstrip().endswith("-")   # no N = 4 int8 record


def test_the_codecs_rates_are_measured_for_every_payload():
    rows = links.codec_rates(numel=1 << 14, reps=1)
    assert [r["compress"] for r in rows] == ["int8", "fp8", "int4", "bf16"]
    assert all(r[k] > 0 for r in rows for k in ("encode_gbps", "encode_change_gbps", "decode_add_gbps"))
    assert "int4" in links.format_codecs(rows)


@pytest.mark.slow
@pytest.mark.skipif(links.missing() is not None, reason=str(links.missing()))
def test_shaped_links_slow_fp32_and_int8_carries_a_quarter_of_the_bytes(tmp_path, capsys):
    out = tmp_path / "links.json"
    rc = links.main(["--nodes", "2", "--rates", "loopback,100mbit", "--sizes", "2", "--modes", "ring,decentralized",
                     "--compress", "none,int8,int4", "--json", str(out), "--png", str(tmp_path / "links.png")])
    assert rc == 0, capsys.readouterr()
    recs = {(r["rate"], r["mode"], r["compress"]): r for r in json.loads(out.read_text())["records"]}
    assert len(recs) == 12
    for (rate, mode, compress), r in recs.items():
        assert r["sent"] == r["analytic"] > 0, r
        if compress != "none":
            assert r["sent"] <= (0.15 if compress == "int4" else 0.30) * recs[(rate, mode, "none")]["sent"]
        assert (r["wire_s"] is None) == (rate == "loopback")
    # 2 MiB of fp32 at 100 Mbit/s takes at least 0.16 s; int8 is faster there, and loopback is faster still
    for mode in ("ring", "decentralized"):
        assert recs[("100mbit", mode, "none")]["seconds"] >= 0.16
        assert recs[("100mbit", mode, "int8")]["seconds"] < recs[("100mbit", mode, "none")]["seconds"]
        assert recs[("loopback", mode, "none")]["seconds"] < recs[("100mbit", mode, "none")]["seconds"]
    assert (tmp_path / "links.png").read_bytes()[:4] == b"\x89PNG"


def test_the_owner_scheme_quantizes_once_where_a_ring_piles_up_an_error_per_hop():
    """Same bytes per node; the owner scheme's error does not grow with N, a ring that
    re-quantizes its partial sums at every hop does."""
    rows = {n: links.mean_schemes(n, 1 << 14, "int8") for n in (2, 8)}
    assert rows[8]["ring_rel_error"] > 1.3 * rows[8]["owner_rel_error"]
    assert rows[8]["owner_rel_error"] == pytest.approx(rows[2]["owner_rel_error"], rel=0.1)
    assert rows[8]["ring_rel_error"] > 1.5 * rows[2]["ring_rel_error"]
