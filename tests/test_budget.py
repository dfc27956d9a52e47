"""Matched budgets (ltcx/study/budget.py, the catalogue's scaling rules in ltcx/models/scaling.py): the three
figures counted exactly, and every catalogue entry matched within 2% at ~1M and ~30M non-embedding parameters and
at the GPT's FLOPs and state there (docs/compare.md, "Matched budgets")."""

from __future__ import annotations

import math

import pytest
import torch
import yaml

from ltcx.errors import ConfigError
from ltcx.models.catalog import CATALOG, config_path
from ltcx.models.config import init_fields
from ltcx.models.state import map_state_tensors
from ltcx.study.budget import match_shape, matched_table, non_embedding_parameters

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 50304
SEQ_LEN = 512
SHAPES = [(name, variant) for name, entry in CATALOG.items() for variant in entry.shapes()]


def returned_state_bytes(state) -> int:
    sizes = []
    map_state_tensors(state, lambda t: sizes.append(t.numel() * t.element_size()))
    return sum(sizes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name,variant", SHAPES, ids=[f"{n}-{v}" for n, v in SHAPES])
def test_state_bytes_are_the_bytes_of_the_state_a_forward_returns(name, variant, dtype):
    """At two token counts, batch 1: a KV cache grows by the same bytes per token, a recurrent state stays the same
    (Titans' window once full; MAC's segment cache with the position in its segment)."""
    torch.manual_seed(0)
    model = CATALOG[name].build_tiny(64, variant).to(dtype).eval()
    for tokens in (9, 23):
        with torch.no_grad():
            _, state = model(torch.randint(0, 64, (1, tokens)))
        assert model.state_bytes(tokens) == returned_state_bytes(state), tokens
    if model.max_seq_len is not None:  # attention over every token: linear in the tokens
        assert model.state_bytes(23) - model.state_bytes(9) == 14 * (model.state_bytes(10) - model.state_bytes(9))
    elif name == "xlstm":
        assert model.state_bytes(9) == model.state_bytes(23)


def test_state_bytes_from_the_config_alone_equal_the_built_models():
    """The search reads the state from a config without building the model (budget._config_only)."""
    from ltcx.study.budget import _config_only

    for name, variant in SHAPES:
        entry = CATALOG[name]
        args = {**entry.shapes()[variant], "vocab_size": 64}
        built = entry.build_tiny(64, variant)
        for dtype in (torch.float32, torch.bfloat16):
            assert _config_only(name, args).state_bytes(17, dtype) == built.state_bytes(17, dtype), (name, variant)


def test_non_embedding_parameters_leave_out_embedding_tables_and_a_head_tied_to_one():
    gpt = CATALOG["gpt"].build_tiny(64)
    c = gpt.config
    assert non_embedding_parameters(gpt) == sum(p.numel() for p in gpt.parameters()) - 64 * c.n_embd \
        - c.block_size * c.n_embd  # tokens and learned positions out; the tied head is the token table
    untied = CATALOG["xlstm"].build_tiny(64, "slstm_first_untied")
    width = untied.config.n_embd
    assert non_embedding_parameters(untied) == sum(p.numel() for p in untied.parameters()) - 64 * width
    assert untied.head.weight.numel() == 64 * width  # an untied head counts
    titans = CATALOG["titans_mag"].build_tiny(64)
    assert non_embedding_parameters(titans) == titans.parameter_count() - 64 * titans.config.n_embd


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_the_rule_at_the_yamls_width_and_depth_is_the_yaml(name):
    """The scaling rule keeps the YAML's proportions: at its width and depth it gives the YAML's model, the fine
    knob aside (Titans' YAMLs set their MLP to the GPT's parameter count; the GPT family's leave it null)."""
    entry = CATALOG[name]
    yaml_args = yaml.safe_load(config_path(name).read_text())["model.backbone"]["init_args"]
    yaml_args = {**yaml_args, "vocab_size": VOCAB, **({"block_size": SEQ_LEN} if "block_size" in yaml_args else {})}
    width = yaml_args["n_embd"]
    rule = entry.scaled(width, entry.scaling.depth, SEQ_LEN)
    for knob in entry.scaling.knobs.values():
        rule[knob.field] = yaml_args.get(knob.field)  # null: the default (4 n_embd)
    config_class = entry.backbone_class().config_class
    assert init_fields(config_class(**rule, vocab_size=VOCAB)) == init_fields(config_class(**yaml_args))


@pytest.mark.parametrize("width", [64, 128, 256, 260, 404, 512])
def test_the_xlstm_chunk_follows_its_mlstm_head_width(width):
    """128 tokens where the mLSTM heads (the config's inner width / heads, computed by the model) are wider than 128,
    else 64: the rule's head width before rounding must fall on the same side of 128 as XLSTMConfig's."""
    entry = CATALOG["xlstm"]
    rule = entry.scaled(width, 8, SEQ_LEN)
    config = entry.backbone_class().config_class(**rule, vocab_size=VOCAB)
    assert rule["chunk_size"] == (128 if config.mlstm_inner_dim // config.n_head > 128 else 64)
    assert entry.scaled(width, 8, 32)["chunk_size"] == 32


def gpt_budget(parameters: float):
    return match_shape("gpt", "params", parameters, SEQ_LEN, VOCAB)


# (architecture, budget, kind) that the YAML's depth +-2 can not reach within 2%, and the depths that do.
# GTA caches 5/8 of the GPT's numbers per token and layer at any width: at 30M it needs 1.6x the GPT's (layers x
# groups), 19 x 2; the xLSTM's state jumps with its inner width's steps of 64 at 1M; at 1M Titans MAC's memory reads
# and writes cost as much as the GPT's head, and width 128 (the next below is 64) reaches its FLOPs at 3 layers.
FARTHER = {("gta", 30e6, "state"): range(2, 25), ("xlstm", 1e6, "state"): range(2, 17),
           ("titans_mac", 1e6, "flops"): range(2, 13)}


@pytest.mark.parametrize("kind", ["params", "flops", "state"])
@pytest.mark.parametrize("budget", [1e6, 30e6], ids=["1M", "30M"])
@pytest.mark.parametrize("name", sorted(CATALOG))
def test_every_architecture_matches_the_gpts_budget_within_2_percent(name, budget, kind):
    target = gpt_budget(budget).figure(kind)
    match = match_shape(name, kind, target, SEQ_LEN, VOCAB, n_layers=FARTHER.get((name, budget, kind)))
    assert match.within, (match.distance, match.init_args)
    assert match.figure() == pytest.approx(target, rel=0.02)
    with torch.device("meta"):  # the figures are the model's own
        model = CATALOG[name].backbone_class()(**match.init_args)
    assert match.parameters == non_embedding_parameters(model)
    assert match.flops_per_token == model.flops_per_token(SEQ_LEN)
    assert match.state_bytes == model.state_bytes(SEQ_LEN, torch.float32)


def test_the_gpt_matches_its_own_shape():
    at = gpt_budget(30e6)
    for kind in ("flops", "state"):
        again = match_shape("gpt", kind, at.figure(kind), SEQ_LEN, VOCAB)
        assert again.distance == 0 and again.width == at.width and again.depth == at.depth


def test_an_unreachable_target_is_the_nearest_shape_with_its_distance_stated():
    small = match_shape("gpt", "params", 10, SEQ_LEN, VOCAB)  # below a one-head, 4-layer GPT
    assert not small.within and small.width == 64 and small.depth == 4
    assert small.distance == pytest.approx(small.parameters / 10 - 1)
    gta = match_shape("gta", "state", gpt_budget(30e6).state_bytes, SEQ_LEN, VOCAB, n_layers=6)
    assert not gta.within and gta.distance < -0.02  # 6 layers of 6 groups: 6% short
    table = matched_table([small, gta])
    assert f"{small.distance:+.2%} (outside 2%)" in table and f"{gta.distance:+.2%} (outside 2%)" in table


def test_a_depth_rule_and_a_depth_list_are_kept():
    by_width = match_shape("gpt", "params", 30e6, SEQ_LEN, VOCAB, n_layers=lambda width: max(2, width // 128))
    assert by_width.depth == max(2, by_width.width // 128) and by_width.within
    listed = match_shape("xlstm", "params", 30e6, SEQ_LEN, VOCAB, n_layers=[4, 12])
    assert listed.depth in (4, 12) and listed.within


@pytest.mark.parametrize("kwargs,message", [
    (dict(kind="bytes"), "budget kind 'bytes' is not one of params, flops, state"),
    (dict(target=-1), "budget target (-1) must be a positive number"),
    (dict(target=math.nan), "budget target (nan) must be a positive number"),
    (dict(n_layers=[0]), "n_layers ([0]) must be positive integers"),
])
def test_bad_requests_are_one_line(kwargs, message):
    request = {**dict(name="gpt", kind="params", target=1e6, seq_len=SEQ_LEN, vocab_size=VOCAB), **kwargs}
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")) as error:
        match_shape(**request)
    assert "\n" not in str(error.value)


def test_the_table_shows_every_figure_side_by_side():
    matches = [match_shape(name, "params", 1e6, SEQ_LEN, VOCAB) for name in ("gpt", "xlstm")]
    lines = matched_table(matches).splitlines()
    assert lines[0] == "| architecture | width x depth | parameters | FLOPs / token | state | distance |"
    assert lines[2].startswith(f"| gpt | {matches[0].width} x {matches[0].depth} | {matches[0].parameters:,} |")
    assert len(lines) == 4


def test_the_quick_recall_shapes_are_the_catalogues_rule_with_heads_of_32():
    """The quick-recall preset at width 64: the shapes recall studies had written by hand (heads of 32, one KV head,
    LTC's modes the head dim, GTA's one group, the xLSTM's 1:1, Titans' MLP 2x and memory heads of 32), N(0, 1/width)
    (``scaled_init``) but for the xLSTM, whose own init scales with the width, and its 2 layers."""
    import dataclasses

    from ltcx.study.plan import plan_shapes
    from ltcx.study.spec import find_spec, load_spec

    spec = load_spec(find_spec("quick-recall"))
    shapes = {shape.arch: shape.init_args for shape in plan_shapes(spec) if shape.size == 64}
    init = dict(init_std=0.125)
    gpt = dict(n_layer=2, n_embd=64, n_head=2, n_kv_head=1, block_size=32, **init)
    expected = {
        "gpt": gpt, "ltc": {**gpt, "num_decay_modes": 32},
        "gta": dict(n_layer=2, n_embd=64, n_head=2, n_query_group=1, block_size=32, key_dim=32, latent_dim=32, **init),
        "xlstm": dict(n_layer=2, n_embd=64, signature=[1, 1], n_head=2, slstm_n_head=2, chunk_size=32),
        "titans_mag": dict(n_layer=2, n_embd=64, n_head=2, n_kv_head=1, mlp_hidden=128, mem_heads=2, mem_head_dim=32,
                           mem_hidden=64, **init),
    }
    for name, shape in expected.items():
        assert {key: shapes[name][key] for key in shape} == shape, name
    assert "init_std" not in shapes["xlstm"]
    unscaled = plan_shapes(dataclasses.replace(spec, scaled_init=False))
    assert all("init_std" not in shape.init_args for shape in unscaled)
