"""Capacity calculator: the published GLM-5.3 numbers, the host-pool threshold, block bytes, CLI."""
import json
import math
from dataclasses import replace
from types import SimpleNamespace

import pytest

from hisparse_jax import calc, calc_cli
from hisparse_jax.config import get_preset
from hisparse_jax.formats import glm_indexer_types

GLM = calc.PRESETS["glm-5.3-blog"]


# GLM-5.3's KV-relevant config: GLM-5's (the library's preset; the calculator, which imports no numpy, states the
# same shape as calc.GLM53_KV_SHAPE, checked equal below).
GLM_CFG = get_preset("glm-5")
# Tiny demo: layers 0,1,2,6 are full -> units {0},{1},{2..5},{6,7}.
DEMO_CFG = SimpleNamespace(num_hidden_layers=8, kv_lora_rank=64, qk_rope_head_dim=16, index_head_dim=64,
                           indexer_types=("full", "full", "full", "shared", "shared", "shared", "full", "shared"))


def test_calc_glm53_kv_shape_is_the_glm5_presets():
    for name in ("num_hidden_layers", "kv_lora_rank", "qk_rope_head_dim", "index_head_dim", "indexer_types"):
        assert getattr(calc.GLM53_KV_SHAPE, name) == getattr(GLM_CFG, name), name
    assert GLM.num_attention_heads == GLM_CFG.num_attention_heads == 64
    assert glm_indexer_types(8) == DEMO_CFG.indexer_types


# --- published numbers (hand-computed: KV = 17.8 GiB -> 6,260 baseline / 103,692 HiSparse blocks) ---

@pytest.mark.parametrize("seq, hot_rows, baseline, hisparse", [
    (81_920, 4096, 4, 39),        # 6260//1280; 103692//(1280 + 20*64 + 40 = 2600)
    (81_920, 10_240, 4, 22),      # 103692//(1280 + 20*160 + 40 = 4520)
    (142_000, 4096, 2, 29),       # n = 2219: 6260//2219; 103692//3539
    (1_048_576, 4096, 0, 5),      # n = 16384: 6260//16384; 103692//17704
])
def test_published_capacity(seq, hot_rows, baseline, hisparse):
    r = calc.max_requests(calc.CalcInput(seq=seq, hot_rows=hot_rows))
    assert (r.baseline_running, r.hisparse_running) == (baseline, hisparse)
    assert r.hisparse_gpu_limit == hisparse and r.limiting == "gpu"


def test_defaults_match_calculator():
    r = calc.max_requests(calc.CalcInput())
    assert r.kv_hbm_gib == pytest.approx(17.8, abs=1e-9)
    assert (r.baseline_pool_blocks, r.hisparse_pool_blocks) == (6260, 103_692)
    assert (r.baseline_blocks_per_request, r.hisparse_gpu_blocks_per_request) == (1280, 2600)
    assert r.groups == 20 and r.block_bytes == GLM.fp8
    assert r.min_host_gib_published == 134 and r.host_gib == 134  # the calculator's default pool
    assert r.min_host_gib == pytest.approx(39 * 1280 * 2_875_392 / 2 ** 30)


def test_kv_hbm_estimate():
    budget = 141e9 / 2 ** 30 * 0.92
    exact = budget - (19.556 / 8 + 684.167 / 8) - 15
    r = calc.max_requests(calc.CalcInput(round_kv_hbm=False))
    assert r.kv_hbm_gib == pytest.approx(exact) and r.kv_hbm_gib == pytest.approx(17.8, abs=0.1)
    dp8 = calc.max_requests(calc.CalcInput(dp=8))  # routed experts over 64 GPUs
    assert dp8.kv_hbm_gib == pytest.approx(round(budget - 19.556 / 8 - 684.167 / 64 - 15, 1))
    assert calc.max_requests(calc.CalcInput(dp=8, ep=False)).kv_hbm_gib == pytest.approx(17.8)
    assert calc.max_requests(calc.CalcInput(kv_hbm_gib=30.0)).kv_hbm_gib == 30.0


def test_bf16_and_totals():
    r = calc.max_requests(calc.CalcInput(kv_dtype="bf16"))  # 3224//1280; 64807//2600
    assert (r.baseline_running, r.hisparse_running) == (2, 24)
    r = calc.max_requests(calc.CalcInput(dp=8, ep=False))
    assert (r.baseline_total, r.hisparse_total) == (32, 312)


def test_limiting_labels():
    assert calc.max_requests(calc.CalcInput(max_seqs=16)).limiting == "max_seqs"
    short = calc.max_requests(calc.CalcInput(seq=1024, hot_rows=8192))  # full residency beats hot buffers
    assert short.limiting == "baseline" and short.hisparse_running == short.baseline_running == 391
    assert short.min_host_gib == 0
    small = calc.max_requests(calc.CalcInput(host_gib=133))  # 49,665 host blocks // 1280 = 38
    assert (small.hisparse_running, small.limiting) == (38, "host")
    assert calc.max_requests(calc.CalcInput(host_gib=math.inf)).hisparse_host_limit is None


@pytest.mark.parametrize("kw", [{}, {"hot_rows": 10_240}, {"seq": 142_000}, {"seq": 1_048_576},
                                {"seq": 8192}, {"kv_dtype": "bf16"}, {"gpu": "b300"}, {"max_seqs": 16}])
def test_min_host_is_the_threshold(kw):
    free = calc.max_requests(calc.CalcInput(host_gib=math.inf, **kw))
    at = calc.max_requests(calc.CalcInput(host_gib=free.min_host_gib, **kw))
    assert at.limiting != "host" and at.hisparse_running == free.hisparse_running
    below = calc.max_requests(calc.CalcInput(host_gib=free.min_host_gib * (1 - 1e-9), **kw))
    assert below.limiting == "host" and below.hisparse_running < free.hisparse_running
    shown = calc.max_requests(calc.CalcInput(host_gib=free.min_host_gib_published, **kw))
    assert shown.hisparse_running == free.hisparse_running


# --- block bytes ---

def test_published_constants_decompose():
    for bb, row in ((GLM.fp8, 576), (GLM.bf16, 1152)):
        assert bb.host == 64 * 78 * row                     # 78 layers of c + kR
        assert bb.baseline - bb.host == 64 * 21 * 132       # 21 FP8 indexer keys (128 + 4), both dtypes
        assert bb.hisparse_gpu % (64 * row) == 0            # whole per-layer MLA pages
    assert GLM.fp8.hisparse_gpu == 5 * 64 * 576 == 184_320  # 177,408 indexer page rounded up to 5 pages
    assert GLM.bf16.hisparse_gpu == 4 * 64 * 1152           # largest hot group: 4 layers
    assert sum(t == "full" for t in GLM_CFG.indexer_types) == 21


def test_block_bytes_from_config_reproduce_preset():
    for dt in ("fp8", "bf16"):
        assert calc.block_bytes(GLM_CFG, dt) == GLM.blocks(dt)
        lay = calc.block_layout(GLM_CFG, dt)
        assert lay.hot_group_layers == (2,) + (4,) * 19 and lay.hot_groups == 20
    derived = calc.preset_from_config(GLM_CFG, "glm-5.3-derived", 19.556, 684.167)
    for seq in (81_920, 142_000, 1_048_576):
        a = calc.max_requests(calc.CalcInput(seq=seq)).to_dict()
        b = calc.max_requests(calc.CalcInput(preset=derived, seq=seq)).to_dict()
        a.pop("inputs"), b.pop("inputs")
        assert a == b
    assert "184,320" in calc.explain_block_bytes(GLM_CFG)


def test_block_bytes_demo_config():
    fp8 = calc.block_layout(DEMO_CFG, "fp8")  # row 80, indexer row 68, 4 full layers
    assert (fp8.host, fp8.indexer_page, fp8.baseline) == (40_960, 17_408, 58_368)
    assert fp8.hot_group_layers == (2, 4, 2) and fp8.hisparse_gpu == 20_480
    bf16 = calc.block_layout(DEMO_CFG, "bf16")  # row 160: pages of 10,240 no longer pair up
    assert bf16.hot_group_layers == (1, 1, 4, 2) and bf16.block_bytes == calc.BlockBytes(99_328, 40_960, 81_920)
    ds = SimpleNamespace(num_hidden_layers=61, kv_lora_rank=512, qk_rope_head_dim=64, index_head_dim=128,
                         indexer_types=("full",) * 61)
    assert calc.block_layout(ds, "fp8", mla_fp8_layout="ds_mla").mla_row == 656
    assert calc.block_layout(ds, "bf16", indexer_dtype="bf16").indexer_row == 256


# --- sweep and CLI ---

def test_sweep_and_plot(tmp_path):
    rows = calc.sweep(calc.CalcInput())
    assert [r["seq"] for r in rows] == list(calc.SWEEP_SEQS) and {74_160, 85_836, 142_000} <= set(calc.SWEEP_SEQS)
    assert rows[0]["seq"] == 8192 and rows[-1]["seq"] == 2 ** 20
    for a, b in zip(rows, rows[1:]):
        assert b["hisparse_running"] <= a["hisparse_running"] and b["baseline_running"] <= a["baseline_running"]
    assert next(r for r in rows if r["seq"] == 142_000)["hisparse_running"] == 29
    pytest.importorskip("matplotlib")
    calc_cli.plot_sweep(rows, str(tmp_path / "sweep.png"))
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("text, tokens", [("81920", 81_920), ("80k", 81_920), ("1m", 2 ** 20), ("81_920", 81_920)])
def test_parse_tokens(text, tokens):
    assert calc_cli.parse_tokens(text) == tokens


def test_cli_json(capsys):
    assert calc_cli.main(["--seq", "80k", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("baseline_running", "hisparse_running", "hisparse_gpu_limit", "hisparse_host_limit",
                "min_host_gib", "kv_hbm_gib", "inputs"):
        assert key in out
    assert (out["baseline_running"], out["hisparse_running"], out["inputs"]["seq"]) == (4, 39, 81_920)
    assert calc_cli.main(["--hot-rows", "10240", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["hisparse_running"] == 22


def test_cli_text_and_sweep(capsys, tmp_path):
    assert calc_cli.main([]) == 0
    assert "17.8 GiB" in capsys.readouterr().out
    assert calc_cli.main(["--sweep"]) == 0
    assert "142,000" in capsys.readouterr().out


@pytest.mark.parametrize("argv, needle", [
    (["--seq", "0"], "positive"), (["--seq", "lots"], "token count"), (["--preset", "nope"], "unknown preset"),
    (["--gpu", "a100"], "invalid choice"), (["--tp", "3"], "does not divide"), (["--tp", "4"], "no HBM left"),
    (["--host-gib", "-1"], "host_gib"), (["--hot-rows", "0"], "hot_rows"),
])
def test_cli_bad_input(capsys, argv, needle):
    assert calc_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_capacity_rejects_bad_input():
    with pytest.raises(calc.CalcError):
        calc.max_requests(calc.CalcInput(seq=-1))
    with pytest.raises(calc.CalcError):
        calc.max_requests(replace(calc.CalcInput(), gpu="h100"))


@pytest.mark.parametrize("dp", [1, 2, 4, 8])
def test_data_parallel_totals_scale_like_the_mesh_engine(dp):
    # a MeshEngine's ranks each have the per-device budgets: at a fixed per-device KV budget and host pool, DP
    # replicas run DP x one replica's requests (experiments/mesh_capacity.py measured 4.00x on 4 devices)
    one = calc.max_requests(calc.CalcInput(dp=1, kv_hbm_gib=17.8, host_gib=math.inf))
    many = calc.max_requests(calc.CalcInput(dp=dp, kv_hbm_gib=17.8, host_gib=math.inf))
    assert (many.baseline_running, many.hisparse_running) == (one.baseline_running, one.hisparse_running)
    assert (many.baseline_total, many.hisparse_total) == (dp * one.baseline_running, dp * one.hisparse_running)
    # with expert parallelism the routed experts' weights divide over DP x TP: more HBM left per GPU for KV
    free = [calc.max_requests(calc.CalcInput(dp=d, ep=True)).kv_hbm_gib for d in (1, dp)]
    assert free[1] >= free[0]


# --- indexer key dtype (--index-dtype) and the H2D cost per decode step ---

def test_indexer_row_bytes_fp8_and_int4():
    # fp8: 128 e4m3 + one fp32 scale; int4 (MXFP4 accounting of vLLM #48558 / SGLang #30546): 64 B of packed
    # 4-bit values + 4 UE8M0 block-32 scales
    assert (calc.indexer_row_bytes(128, "fp8"), calc.indexer_row_bytes(128, "int4")) == (132, 68)
    assert calc.indexer_row_bytes(64, "int4") == 32 + 2 and calc.indexer_row_bytes(128, "bf16") == 256
    with pytest.raises(calc.CalcError):
        calc.indexer_row_bytes(128, "int8")
    lay = calc.block_layout(GLM_CFG, "fp8", indexer_dtype="int4")
    assert lay.indexer_row == 68 and lay.indexer_page == 64 * 21 * 68 == 91_392
    assert lay.hot_group_layers == (2,) + (4,) * 19  # a 4-layer unit is never split, so still 20 groups
    # the shared pool's block is now the largest hot group's page, not the (smaller) indexer page
    assert lay.hisparse_gpu == lay.hisparse_gpu_unpadded == 4 * 64 * 576 == 147_456
    assert lay.block_bytes == calc.BlockBytes(2_875_392 + 91_392, 147_456, 2_875_392)
    assert GLM.blocks("fp8", "int4") == lay.block_bytes and GLM.blocks("fp8", "fp8") == GLM.fp8


@pytest.mark.parametrize("seq, hot_rows, baseline, hisparse", [
    (81_920, 4096, 4, 39), (81_920, 10_240, 4, 22), (142_000, 4096, 2, 29), (1_048_576, 4096, 0, 5)])
def test_fp8_index_dtype_leaves_the_published_numbers(seq, hot_rows, baseline, hisparse):
    default = calc.max_requests(calc.CalcInput(seq=seq, hot_rows=hot_rows))
    fp8 = calc.max_requests(calc.CalcInput(seq=seq, hot_rows=hot_rows, index_dtype="fp8"))
    assert (fp8.baseline_running, fp8.hisparse_running) == (baseline, hisparse)  # the pins of test_published_capacity
    assert fp8.block_bytes == GLM.fp8 and fp8.groups == 20 and fp8.index_dtype == "fp8"
    assert fp8.to_dict() == default.to_dict()
    assert (fp8.indexer_bytes_per_token_layer, fp8.indexer_bytes_per_token) == (132, 21 * 132)


def test_int4_capacity_at_1m():
    fp8 = calc.max_requests(calc.CalcInput(seq=2 ** 20))
    int4 = calc.max_requests(calc.CalcInput(seq=2 ** 20, index_dtype="int4"))
    # n = 16,384 + 20 groups * (64 + 2) = 17,704 blocks per request either way; only the block shrinks:
    # floor(17.8 GiB / 184,320) = 103,692 -> 5, floor(17.8 GiB / 147,456) = 129,615 -> 7
    assert (int4.hisparse_pool_blocks, int4.hisparse_gpu_blocks_per_request) == (129_615, 17_704)
    assert (fp8.hisparse_running, int4.hisparse_running) == (5, 7) and int4.limiting == "gpu"
    assert int4.hisparse_running >= 1.4 * fp8.hisparse_running
    # not 1.8x: the block only shrinks 1.25x (the hot groups' 4-layer page bounds it), so the pool grows 1.25x
    assert fp8.block_bytes.hisparse_gpu / int4.block_bytes.hisparse_gpu == 1.25
    assert int4.hisparse_pool_blocks <= 1.25 * fp8.hisparse_pool_blocks + 1
    assert (int4.baseline_running, int4.block_bytes.baseline) == (0, 2_966_784)
    for seq in calc.SWEEP_SEQS:  # never fewer requests with the smaller key
        a, b = (calc.max_requests(calc.CalcInput(seq=seq, index_dtype=d)) for d in ("fp8", "int4"))
        assert b.hisparse_running >= a.hisparse_running and b.baseline_running >= a.baseline_running


def test_host_tier_index_keys_at_1m():
    """The indexer keys in the host tier (issue 34's calculator): the GPU keeps 8 B per token and full layer (bf16
    min / max per dimension per page) and a request's hot and tail pages, so HiSparse runs 51 requests per replica
    at 1M, >= 10x the device tier's 5, GPU-limited, with the keys beside the KV in the host pool; but every step
    reads `index_read_fraction` of each request's key history over the link (3 s per step at the exact mode's 1)."""
    dev = calc.max_requests(calc.CalcInput(seq=2 ** 20))
    host = calc.max_requests(calc.CalcInput(seq=2 ** 20, index_tier="host"))
    n, F, row = 2 ** 20 // 64, 21, 132
    assert dev.hisparse_running == 5 and dev.index_tier == "device" and dev.index_h2d_bytes_per_request_step == 0
    assert host.hisparse_running == 51 >= 10 * dev.hisparse_running and host.limiting == "gpu"
    assert host.index_summary_bytes_per_token == F * 8
    assert host.hisparse_gpu_blocks_per_request == 66 + -(-n * 64 * F * 8 // 2_875_392)  # in host blocks
    assert host.min_host_gib == pytest.approx(51 * n * (2_875_392 + 64 * F * row) / 2 ** 30)
    assert host.index_h2d_bytes_per_request_step == n * 64 * F * row
    kv_misses = (1 - host.hit_rate) * 2048 * 2_875_392 / 64
    assert host.h2d_bytes_per_request_step == pytest.approx(kv_misses + n * 64 * F * row)
    assert host.h2d_ms_per_step == pytest.approx(51 * host.h2d_bytes_per_request_step / 50e9 * 1e3)
    part = calc.max_requests(calc.CalcInput(seq=2 ** 20, index_tier="host", index_read_fraction=0.03))
    assert part.index_h2d_bytes_per_request_step == pytest.approx(0.03 * n * 64 * F * row)
    assert part.hisparse_running == 51 and part.h2d_ms_per_step < 120
    small = calc.max_requests(calc.CalcInput(seq=2 ** 20, index_tier="host", index_summary_bytes=2.0))
    assert small.hisparse_running > host.hisparse_running  # a smaller summary fits more
    # the store's layout: summaries in a pool of their own (no rounding to host blocks), the bytes counted exactly
    split = calc.max_requests(calc.CalcInput(seq=2 ** 20, index_tier="host", layout="split"))
    page = 64 * F * 8
    per_req = n + -(-66 * 2_875_392 // page)  # every summary page + the hot and tail KV pages in summary pages
    assert split.block_bytes.hisparse_gpu == page and split.hisparse_gpu_blocks_per_request == per_req
    assert split.hisparse_running == math.floor(split.kv_hbm_gib * 2 ** 30 / page) // per_req
    assert split.hisparse_running >= host.hisparse_running
    for bad, match in ((dict(index_tier="disk"), "index_tier must be one of"),
                       (dict(index_read_fraction=1.5), "index_read_fraction must be in"),
                       (dict(index_summary_bytes=-1.0), "index_summary_bytes must be")):
        with pytest.raises(calc.CalcError, match=match):
            calc.max_requests(calc.CalcInput(**bad))
    with pytest.raises(calc.CalcError, match="index_tier='host' needs a preset with a KV shape"):
        calc.max_requests(calc.CalcInput(preset=replace(GLM, name="bare", kv_shape=None), index_tier="host"))


def test_calc_cli_host_tier_json(capsys):
    assert calc_cli.main(["--seq", "1m", "--index-tier", "host", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["hisparse_running"], d["index_tier"], d["index_read_fraction"]) == (51, "host", 1.0)
    assert d["inputs"]["index_tier"] == "host" and d["h2d_ms_per_step"] > 1000
    assert calc_cli.main(["--seq", "1m", "--index-tier", "host", "--index-read-fraction", "0.03"]) == 0
    out = capsys.readouterr().out
    assert "host-tier keys" in out and "of which indexer keys" in out and "GPU summary 168 B / token" in out
    assert calc_cli.main(["--index-read-fraction", "-0.5"]) == 2



def test_host_tier_rvq_summary():
    """index_summary="rvq": per key d / 16 - 1 one-byte codes and an e4m3 radius, the box's bytes per token (8 at
    d = 128), plus a fixed 7 codebooks x 256 centroids x 128 bf16 per full layer on every GPU, off HiSparse's pool."""
    for cfg in (GLM_CFG, DEMO_CFG):  # d = 128 (7 codes + radius) and d = 64 (3 + 1): 4 d / 64 = d / 16
        lay = calc.block_layout(cfg)
        assert calc.index_summary_bytes(lay, "rvq") == calc.index_summary_bytes(lay) == cfg.index_head_dim / 16
    codebooks = 7 * 256 * 128 * 2 * 21  # stages x centroids x d x bf16 x GLM-5.3's full layers, per GPU
    assert codebooks == 9_633_792
    n, host_block = 2 ** 20 // 64, 2_875_392
    box, rvq = (calc.max_requests(calc.CalcInput(seq=2 ** 20, index_tier="host", index_summary=k))
                for k in ("box", "rvq"))
    assert rvq.index_summary_bytes_per_token == box.index_summary_bytes_per_token == 21 * 8
    assert (box.index_codebook_bytes, rvq.index_codebook_bytes) == (0, codebooks)
    assert rvq.kv_hbm_gib == box.kv_hbm_gib and rvq.baseline_running == box.baseline_running  # HiSparse's alone
    per_req = 66 + -(-n * 64 * 168 // host_block)  # hot and tail pages + the summaries in host blocks
    assert rvq.hisparse_gpu_blocks_per_request == box.hisparse_gpu_blocks_per_request == per_req
    assert box.hisparse_pool_blocks == math.floor(box.kv_hbm_gib * 2 ** 30 / host_block)
    assert rvq.hisparse_pool_blocks == math.floor((box.kv_hbm_gib * 2 ** 30 - codebooks) / host_block)
    assert rvq.hisparse_pool_blocks < box.hisparse_pool_blocks
    assert rvq.hisparse_gpu_limit == rvq.hisparse_pool_blocks // rvq.hisparse_gpu_blocks_per_request
    # split: the block is one page's summaries (64 * 168 B), the codebooks exactly 896 of them; a pool of exactly
    # two requests' blocks holds two with box and one with rvq
    page = 64 * 21 * 8
    per_req = n + -(-66 * host_block // page)
    kv = 2 * per_req * page / 2 ** 30
    box, rvq = (calc.max_requests(calc.CalcInput(seq=2 ** 20, index_tier="host", layout="split", index_summary=k,
                                                 kv_hbm_gib=kv)) for k in ("box", "rvq"))
    assert (box.hisparse_pool_blocks, rvq.hisparse_pool_blocks) == (2 * per_req, 2 * per_req - codebooks // page)
    assert codebooks // page * page == codebooks and codebooks // page == 896
    assert (box.hisparse_gpu_limit, rvq.hisparse_gpu_limit) == (2, 1)
    over = calc.max_requests(calc.CalcInput(seq=2 ** 20, index_tier="host", index_summary="rvq",
                                            index_summary_bytes=2.0))  # the override is per token only
    assert over.index_summary_bytes_per_token == 21 * 2.0 and over.index_codebook_bytes == codebooks
    with pytest.raises(calc.CalcError, match="index_summary='rvq' is what the GPU keeps of index_tier='host'"):
        calc.max_requests(calc.CalcInput(index_summary="rvq"))
    with pytest.raises(calc.CalcError, match="index_summary must be one of box, rvq, got 'pq'"):
        calc.max_requests(calc.CalcInput(index_tier="host", index_summary="pq"))


def test_calc_cli_rvq_summary(capsys):
    assert calc_cli.main(["--seq", "1m", "--index-tier", "host", "--index-summary", "rvq"]) == 0
    out = capsys.readouterr().out
    assert "GPU summary 168 B / token (rvq) + codebooks 9,633,792 B / GPU" in out
    assert calc_cli.main(["--seq", "1m", "--index-tier", "host", "--index-summary", "rvq", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["index_codebook_bytes"], d["inputs"]["index_summary"]) == (7 * 256 * 128 * 2 * 21, "rvq")
    assert calc_cli._parser().parse_args([]).index_summary == "box"
    assert calc_cli.main(["--index-summary", "rvq"]) == 2  # the device tier keeps the keys themselves
    assert "index_tier='device' leave it 'box'" in capsys.readouterr().err
    assert calc_cli.main(["--index-summary", "pq"]) == 2
    assert "argument --index-summary: unknown index summary 'pq'" in capsys.readouterr().err


def test_split_layout_int4_at_1m():
    """The layout of this project's store (indexer keys in a pool of their own, a hot / tail page holding every
    layer): the block is the indexer page, so int4 halves it and HiSparse runs 11 requests per replica at 1M
    against FP8's 6 (1.83x; the unified layout's 7 vs 5 is bounded by the 4-layer hot-group page)."""
    fp8 = calc.max_requests(calc.CalcInput(seq=2 ** 20, layout="split"))
    int4 = calc.max_requests(calc.CalcInput(seq=2 ** 20, index_dtype="int4", layout="split"))
    assert (fp8.block_bytes.hisparse_gpu, int4.block_bytes.hisparse_gpu) == (177_408, 91_392)  # 64 x 21 x 132 / 68
    # 16,384 indexer pages + the 64 hot + 2 tail KV pages of 2,875,392 bytes, in indexer pages (rounded up)
    assert fp8.hisparse_gpu_blocks_per_request == 16_384 + -(-66 * 2_875_392 // 177_408)
    assert int4.hisparse_gpu_blocks_per_request == 16_384 + -(-66 * 2_875_392 // 91_392)
    assert (fp8.hisparse_running, int4.hisparse_running) == (6, 11) and int4.limiting == "gpu"
    assert int4.hisparse_running >= 1.8 * fp8.hisparse_running
    assert fp8.layout == int4.layout == "split" and int4.to_dict()["inputs"]["layout"] == "split"
    unified = calc.max_requests(calc.CalcInput(seq=2 ** 20))
    assert unified.layout == "unified" and unified.hisparse_running == 5  # the default is the published model
    with pytest.raises(calc.CalcError, match="layout must be one of"):
        calc.max_requests(calc.CalcInput(layout="paged"))
    bare = replace(GLM, name="bare", kv_shape=None)
    with pytest.raises(calc.CalcError, match="needs a preset with a KV shape"):
        calc.max_requests(calc.CalcInput(preset=bare, layout="split"))


def test_int4_needs_a_kv_shape():
    bare = replace(GLM, name="bare", kv_shape=None)
    assert calc.max_requests(calc.CalcInput(preset=bare)).hisparse_running == 39
    assert calc.max_requests(calc.CalcInput(preset=bare)).indexer_bytes_per_token_layer is None
    with pytest.raises(calc.CalcError, match="no KV shape"):
        calc.max_requests(calc.CalcInput(preset=bare, index_dtype="int4"))
    derived = calc.preset_from_config(GLM_CFG, "glm-5.3-derived", 19.556, 684.167)
    a = calc.max_requests(calc.CalcInput(index_dtype="int4")).to_dict()
    b = calc.max_requests(calc.CalcInput(preset=derived, index_dtype="int4")).to_dict()
    a.pop("inputs"), b.pop("inputs")
    assert a == b


def test_a_preset_can_count_the_stores_656_byte_fp8_row():
    """preset_from_config(..., mla_fp8_layout="ds_mla"): the blocks of this project's store (c e4m3 + a scale per
    128 + r bf16 = 656 B per token and layer), for FP8 and int4 keys and both layouts; split-layout capacity by
    hand."""
    ds = calc.preset_from_config(GLM_CFG, "glm-ds", 19.556, 684.167, mla_fp8_layout="ds_mla")
    assert ds.fp8.host == 64 * 78 * 656 and ds.fp8.baseline == 64 * 78 * 656 + 64 * 21 * 132
    for dt, idx in (("fp8", 132), ("int4", 68)):
        r = calc.max_requests(calc.CalcInput(preset=ds, index_dtype=dt, layout="split", kv_hbm_gib=1.0,
                                             max_seqs=10 ** 6))
        page = 64 * 21 * idx
        assert r.block_bytes.host == 64 * 78 * 656 and r.block_bytes.hisparse_gpu == page
        per_req = 1280 + -(-(64 + 2) * 64 * 78 * 656 // page)  # 80K tokens; 4096 hot rows + 2 tail pages
        assert r.hisparse_gpu_blocks_per_request == per_req and r.hisparse_gpu_limit == (2 ** 30 // page) // per_req
    assert calc.max_requests(calc.CalcInput(preset=ds)).block_bytes.host == 64 * 78 * 656  # unified, FP8 too


def test_h2d_bytes_by_hand():
    r = calc.max_requests(calc.CalcInput(hit_rate=0.75))  # 80K, 39 HiSparse requests
    per_req = 0.25 * 2048 * 78 * 576                 # misses x layers x FP8 MLA row
    assert per_req == 23_003_136 and r.h2d_bytes_per_request_step == per_req
    assert r.h2d_bytes_per_step == 39 * per_req == 897_122_304
    assert r.h2d_ms_per_step == pytest.approx(897_122_304 / 50e9 * 1e3)  # 17.94 ms at 50 GB/s
    assert (r.hit_rate, r.hit_rate_source, r.top_k, r.link_gb_per_s) == (0.75, "input", 2048, 50.0)
    r = calc.max_requests(calc.CalcInput(hit_rate=0.5, top_k=1024, link_gb_per_s=25, kv_dtype="bf16"))
    assert r.h2d_bytes_per_request_step == 0.5 * 1024 * 78 * 1152 and r.hisparse_running == 24
    assert r.h2d_ms_per_step == pytest.approx(24 * 0.5 * 1024 * 78 * 1152 / 25e9 * 1e3)
    assert calc.max_requests(calc.CalcInput(hit_rate=1.0)).h2d_bytes_per_step == 0
    # the index dtype changes how many requests copy, not what one copies
    a, b = (calc.max_requests(calc.CalcInput(seq=2 ** 20, hit_rate=0.75, index_dtype=d)) for d in ("fp8", "int4"))
    assert a.h2d_bytes_per_request_step == b.h2d_bytes_per_request_step
    assert (a.h2d_bytes_per_step, b.h2d_bytes_per_step) == (5 * per_req, 7 * per_req)
    short = calc.max_requests(calc.CalcInput(seq=1024, hot_rows=8192, hit_rate=0.5))  # all resident: nothing to copy
    assert short.limiting == "baseline" and short.h2d_bytes_per_step == 0
    assert short.h2d_bytes_per_request_step == 0.5 * 1024 * 78 * 576  # min(top_k, seq) rows


def test_default_hit_rate_is_the_measured_one():
    rate, source = calc.default_hit_rate()
    r = calc.max_requests(calc.CalcInput())
    assert (r.hit_rate, r.hit_rate_source) == (rate, source)
    if calc.DEMO_RESULTS.exists():
        measured = json.loads(calc.DEMO_RESULTS.read_text())["policies"]["hisparse"]["hit_rate"]
        assert (rate, source) == (measured, "experiments/results/demo.json")
    else:
        assert (rate, source) == (calc.DEFAULT_HIT_RATE, "default")
    assert calc._demo_hit_rate("/nonexistent/demo.json") is None


def test_cli_index_dtype_json(capsys):
    assert calc_cli.main(["--seq", "1m", "--json"]) == 0
    fp8 = json.loads(capsys.readouterr().out)
    assert calc_cli.main(["--seq", "1m", "--index-dtype", "int4", "--json", "--hit-rate", "0.75",
                      "--link-gb-per-s", "25", "--top-k", "2048"]) == 0
    int4 = json.loads(capsys.readouterr().out)
    assert (fp8["index_dtype"], fp8["indexer_bytes_per_token_layer"], fp8["hisparse_running"]) == ("fp8", 132, 5)
    assert (int4["index_dtype"], int4["indexer_bytes_per_token_layer"], int4["indexer_bytes_per_token"]) == (
        "int4", 68, 21 * 68)
    assert int4["inputs"]["index_dtype"] == "int4" and int4["hisparse_running"] == 7
    assert int4["block_bytes"] == {"baseline": 2_966_784, "hisparse_gpu": 147_456, "host": 2_875_392}
    assert (int4["hit_rate"], int4["hit_rate_source"], int4["link_gb_per_s"]) == (0.75, "input", 25.0)
    assert int4["h2d_bytes_per_step"] == 7 * 23_003_136
    assert int4["h2d_ms_per_step"] == pytest.approx(7 * 23_003_136 / 25e9 * 1e3)
    assert calc_cli.main(["--index-dtype", "int4", "--sweep", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["sweep"]
    assert all(r["index_dtype"] == "int4" and "h2d_ms_per_step" in r for r in rows)
    assert rows[-1]["hisparse_running"] == 7


def test_cli_index_dtype_text_sweep_and_plot(capsys, tmp_path):
    assert calc_cli.main(["--index-dtype", "int4", "--hit-rate", "0.75"]) == 0
    out = capsys.readouterr().out
    # 49 requests x 23,003,136 B = 1,127,153,664 B; / 50 GB/s = 22.54 ms
    assert calc.max_requests(calc.CalcInput(index_dtype="int4")).hisparse_running == 49
    assert "indexer int4" in out and "68 B / token" in out and "1,127.2 MB" in out and "22.54 ms" in out
    assert calc_cli.main(["--sweep", "--index-dtype", "int4"]) == 0
    out = capsys.readouterr().out
    assert "indexer int4" in out and "H2D ms/step" in out
    pytest.importorskip("matplotlib")
    rows, other = (calc.sweep(calc.CalcInput(index_dtype=d)) for d in ("fp8", "int4"))
    calc_cli.plot_sweep(rows, str(tmp_path / "both.png"), other)
    assert (tmp_path / "both.png").read_bytes()[:4] == b"\x89PNG"
    assert calc_cli.main(["--sweep", "--plot", str(tmp_path / "cli.png")]) == 0
    assert (tmp_path / "cli.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("option, value", [
    ("--index-dtype", "int8"), ("--index-dtype", "FP8"), ("--index-dtype", ""),
    *[("--hit-rate", v) for v in ("1.5", "-0.1", "nan", "inf", "x")],
    ("--top-k", "0"), ("--top-k", "1.5"), *[("--link-gb-per-s", v) for v in ("0", "-1", "inf", "nan")],
])
def test_cli_bad_index_dtype_and_h2d_options(capsys, monkeypatch, option, value):
    from hisparse_jax import cli

    def refuse(*a, **k):
        raise AssertionError("work started despite a bad argument")

    monkeypatch.setattr(calc_cli, "max_requests", refuse)
    assert cli.main(["calc", f"{option}={value}"]) == 2
    err = capsys.readouterr().err
    assert "usage: hisparse calc" in err and f"error: argument {option}: " in err and "Traceback" not in err, err


def test_capacity_rejects_bad_h2d_inputs():
    for kw in ({"index_dtype": "int8"}, {"hit_rate": 1.5}, {"hit_rate": -0.1}, {"hit_rate": math.nan},
               {"top_k": 0}, {"link_gb_per_s": 0}, {"link_gb_per_s": math.inf}):
        with pytest.raises(calc.CalcError):
            calc.max_requests(calc.CalcInput(**kw))
