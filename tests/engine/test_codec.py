"""The int8 / fp8 / int4 block codec and the bf16 codec, and compressed consensus in one process:
the public-copy schemes reach the least-squares optimum itself, on every mode."""
import pytest
import torch

from admm_dist.core.errors import UserError
from admm_dist.engine.comm import LocalCommunicator
from admm_dist.engine.codec import BLOCK, check_compress, codec, decode_, encode, payload_bytes
from admm_dist.engine.lsq import LeastSquares, solve


@pytest.mark.parametrize("compress,bound", [("int8", 0.5 / 127), ("fp8", 2.0 ** -4), ("int4", 0.5 / 7)])
@pytest.mark.parametrize("p", [1, BLOCK - 1, BLOCK, BLOCK + 1, 1001])
def test_a_payload_is_codes_and_block_scales_and_decodes_within_the_formats_step(compress, bound, p):
    v = torch.randn(p, generator=torch.Generator().manual_seed(p)) * 3
    v[0] = 0.0
    payload = encode(v, compress)
    codes = p if compress != "int4" else p // BLOCK * BLOCK // 2 + (p % BLOCK + 1) // 2   # two to a byte
    assert payload.dtype == torch.uint8
    assert payload.numel() == payload_bytes(p, compress) == codes + 4 * -(-p // BLOCK)
    out = decode_(torch.empty(p), payload, compress)
    # every value within half an int8 step (or e4m3's relative step) of its block's absmax
    for lo in range(0, p, BLOCK):
        blk, got = v[lo:lo + BLOCK], out[lo:lo + BLOCK]
        assert float((got - blk).abs().max()) <= bound * float(blk.abs().max()) + 1e-12
    assert torch.equal(decode_(torch.empty(p), payload.clone(), compress), out)   # deterministic
    assert torch.equal(decode_(torch.empty(5), encode(torch.zeros(5), compress), compress), torch.zeros(5))


def test_int8_and_fp8_cost_about_a_quarter_of_fp32_int4_under_015_and_unknown_names_are_refused():
    p = 1 << 20
    assert payload_bytes(p, "none") == 4 * p
    assert payload_bytes(p, "int8") / (4 * p) == pytest.approx(0.2656, abs=1e-4)
    assert payload_bytes(p, "fp8") == payload_bytes(p, "int8")
    assert payload_bytes(p, "int4") / (4 * p) == pytest.approx(0.1406, abs=1e-4)
    assert payload_bytes(p, "int4") <= 0.15 * 4 * p
    with pytest.raises(UserError, match="choose one of none, int8, fp8, int4"):
        check_compress("int2")


@pytest.mark.parametrize("p", [1, BLOCK - 1, BLOCK, BLOCK + 1, 1001])
def test_a_bf16_payload_is_the_values_rounded_to_nearest_even_in_half_the_bytes(p):
    """2 bytes a value, no scale; each value the nearest bfloat16 (ties to even), which decodes
    to fp32 exactly: within 2^-8 of each value, so ||v - Q(v)|| <= 2^-8 ||v|| (contractive)."""
    v = torch.randn(p, generator=torch.Generator().manual_seed(p)) * 3
    v[0] = 0.0
    payload = encode(v, "bf16")
    assert payload.dtype == torch.uint8 and payload.numel() == payload_bytes(p, "bf16") == 2 * p
    out = decode_(torch.empty(p), payload, "bf16")
    assert torch.equal(out, v.to(torch.bfloat16).float())
    assert bool(((out - v).abs() <= 2.0 ** -8 * v.abs()).all())
    assert float((out - v).norm()) <= 2.0 ** -8 * float(v.norm())
    assert torch.equal(decode_(torch.empty(p), payload.clone(), "bf16"), out)   # deterministic
    assert torch.equal(decode_(torch.empty(5), encode(torch.zeros(5), "bf16"), "bf16"), torch.zeros(5))


def test_bf16_rounds_halfway_values_to_the_even_neighbour():
    """1 + 2^-8 lies halfway between 1 and 1 + 2^-7 (bf16 keeps 7 fraction bits): it goes to 1,
    the even one; 1 + 3 * 2^-8, halfway between 1 + 2^-7 and 1 + 2^-6, goes up to the even 1 + 2^-6."""
    ties = torch.tensor([1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, -(1 + 2.0 ** -8), 1 + 2.0 ** -8 + 2.0 ** -20])
    got = decode_(torch.empty(4), encode(ties, "bf16"), "bf16")
    assert got.tolist() == [1.0, 1 + 2.0 ** -6, -1.0, 1 + 2.0 ** -7]


def test_bf16_costs_exactly_half_of_fp32():
    for p in (1, BLOCK + 1, 1 << 20):
        assert payload_bytes(p, "bf16") * 2 == payload_bytes(p, "none")


@pytest.mark.parametrize("compress", ["int8", "fp8", "int4", "bf16"])
@pytest.mark.parametrize("p", [BLOCK * 40, BLOCK * 40 + 13])
def test_a_payload_cut_at_block_boundaries_is_the_payloads_of_its_pieces(compress, p):
    """What lets the transport encode, send and decode a message piece by piece: every cut at a
    block boundary codes its values exactly as the whole does, and the sender's public copy
    moves by exactly what a receiver decodes."""
    c = codec(compress)
    g = torch.Generator().manual_seed(p)
    v, h = torch.randn(p, generator=g), torch.randn(p, generator=g) * 0.1
    whole = encode(v - h, compress)
    cut, bytes_cut = BLOCK * 17, c.payload_bytes(BLOCK * 17)
    assert c.values(bytes_cut, whole.numel(), p) == (BLOCK * 17, p)
    pieces, moved = torch.empty_like(whole), h.clone()
    c.encode_(pieces[:bytes_cut], v[:cut], moved[:cut])
    c.encode_(pieces[bytes_cut:], v[cut:], moved[cut:])
    assert torch.equal(pieces, whole)
    received = h.clone()
    c.decode_(received[:cut], whole[:bytes_cut], add=True)
    c.decode_(received[cut:], whole[bytes_cut:], add=True)
    assert torch.equal(received, moved)
    assert torch.equal(received, h + decode_(torch.empty(p), whole, compress))


@pytest.mark.parametrize("mode,topology", [("ring", "ring"), ("coordinator", "ring"),
                                           ("decentralized", "ring"), ("decentralized", "chain")])
@pytest.mark.parametrize("compress", ["int8", "fp8", "int4", "bf16"])
def test_compressed_modes_reach_the_optimum_not_a_neighbourhood(mode, topology, compress):
    """Least squares, 4 nodes, exact x-steps: the change against a public copy is what is
    quantized, so the error of the codec vanishes with the iterates' changes."""
    p = LeastSquares(n_nodes=4, seed=0)
    x_star = p.optimum()
    engine, hist = solve(p, consensus=mode, topology=topology, rho=1.0, rounds=150, compress=compress)
    err = max(float((x.double() - x_star).norm() / x_star.norm()) for x in engine.x)
    assert err <= 1e-5, (mode, topology, compress, err)
    comm = engine.comm
    assert hist[-1].bytes_sent == [comm.analytic_bytes(p.dim, i) for i in range(4)]
    if mode != "decentralized":   # one z for every node, bit for bit
        assert all(torch.equal(z, engine.z[0]) for z in engine.z)


def test_compressed_gossip_keeps_the_seeds_fixed_point():
    """Gossip is biased whatever the codec: compressed gossip settles where fp32 gossip does."""
    p = LeastSquares(n_nodes=4, seed=0)
    fp32, _ = solve(p, consensus="gossip", rho=1.0, rounds=400)
    int8, _ = solve(p, consensus="gossip", rho=1.0, rounds=400, compress="int8")
    for a, b in zip(fp32.x, int8.x):
        assert float((a - b).norm() / b.norm()) <= 1e-4


@pytest.mark.parametrize("compress", ["int8", "int4", "bf16"])
def test_the_public_copies_are_per_node_state_that_restores_the_run(compress):
    """Stopping after 30 rounds and restoring x, z, u and each node's public copies into a new
    engine continues bit for bit."""
    from admm_dist.engine.admm import ADMMConfig, ADMMEngine

    p = LeastSquares(n_nodes=4, seed=0)
    whole, _ = solve(p, consensus="decentralized", topology="chain", rho=1.0, rounds=60, compress=compress)
    first, _ = solve(p, consensus="decentralized", topology="chain", rho=1.0, rounds=30, compress=compress)
    comm = LocalCommunicator(mode="decentralized", n_nodes=4, topology="chain", compress=compress)
    again = ADMMEngine(comm, ADMMConfig(rho=1.0), [torch.zeros(p.dim) for _ in range(4)])
    state = first.state_dict()
    for node in range(4):   # the engine's state holds each node's public copies
        assert {k for k in state["nodes"][node] if k.startswith("comm.")} == \
            {f"comm.hat.{j}" for j in [node] + comm.neighbours[node]}
    again.load_state_dict(state)
    again.run(p.exact_xstep(), 30)
    assert all(torch.equal(a, b) for a, b in zip(again.x, whole.x))


def test_the_formats_are_registered_once_and_every_user_has_a_codec_of_its_own():
    """COMPRESSIONS (and so every compress option) follow the one registry, and a codec, whose
    scratch buffers change on every call, is never shared: each algorithm makes its own."""
    from admm_dist.engine import codec as codecs

    assert codecs.COMPRESSIONS == ("none", *codecs.FORMATS)
    assert all(codec(name).name == name for name in codecs.FORMATS if check_compress(name))
    a, b = (LocalCommunicator(mode="ring", n_nodes=3, compress="int8") for _ in range(2))
    assert a.algorithm.codec is not b.algorithm.codec
    assert not any(isinstance(v, (dict, codecs.Codec)) and v for k, v in vars(codecs).items()
                   if not k.isupper() and not k.startswith("__"))   # no module-level cache of codecs
