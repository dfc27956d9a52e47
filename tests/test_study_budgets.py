"""A study's plan against the models its runs build: planned parameters, FLOPs and state are those of the model built
at the vocabulary the data really gives it (GPT-2's 50,304 padded, the bytes tokenizer's 320), for every catalogue
entry; and every head_dim a spec may give (16, 24, 32, 48 here) either plans shapes that build or is refused in one
line naming the values that build."""

import pytest
import torch
import yaml

from ltcx.errors import ConfigError
from ltcx.models import catalog
from ltcx.models.catalog import CATALOG
from ltcx.study.budget import TOLERANCE, non_embedding_parameters
from ltcx.study.plan import plan_shapes, vocab_size
from ltcx.study.spec import load_spec


def spec_file(tmp_path, **changes):
    spec = {**dict(archs=["gpt"], size_by="params", sizes=[2e5], match="flops", block_size=64, batch_size=8, steps=8,
                   learning_rates=[1e-3, 3e-3], seeds=[0, 1], metric="loss"), **changes}
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(spec))
    return load_spec(path)


def built(name, init_args, vocab, seq_len):
    """(non-embedding parameters, FLOPs per token, state bytes) of the model a run builds, counted on it."""
    with torch.device("meta"):
        model = catalog.get(name).backbone_class()(**init_args, vocab_size=vocab)
    return non_embedding_parameters(model), float(model.flops_per_token(seq_len)), int(model.state_bytes(seq_len))


@pytest.mark.parametrize("tokenizer, vocab", [("gpt2", 50304), ("bytes", 320)])
@pytest.mark.parametrize("name", sorted(CATALOG))
def test_planned_budgets_are_those_of_the_model_built_at_the_datas_vocabulary(tmp_path, name, tokenizer, vocab):
    from ltcx.data import TextDataModule

    assert TextDataModule(path="sample", tokenizer=tokenizer).padded_vocab_size == vocab  # what the CLI links
    spec = spec_file(tmp_path, archs=sorted({"gpt", name}, key=lambda a: a != "gpt"), sizes=[1e6], layers=2,
                     data={"path": "sample", "tokenizer": tokenizer})
    assert vocab_size(spec, name)[1] == vocab
    shapes = {shape.arch: shape for shape in plan_shapes(spec)}
    gpt = built("gpt", shapes["gpt"].init_args, vocab, 64)
    mine = built(name, shapes[name].init_args, vocab, 64)
    # the GPT matched on its non-embedding parameters, the others on its FLOPs per token
    distance = gpt[0] / 1e6 - 1 if name == "gpt" else mine[1] / gpt[1] - 1
    assert distance == pytest.approx(shapes[name].distance, abs=1e-12)  # the table's distance is the built model's
    assert (abs(distance) <= TOLERANCE) == (abs(shapes[name].distance) <= TOLERANCE)


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_every_head_dim_plans_shapes_that_build_or_is_one_line_naming_those_that_do(tmp_path, name):
    data = {"configs": ["data/mqar"], "data": {"vocab_size": 64, "num_kv_pairs": 2}, "metric": "recall_acc"}
    for size_by, sizes in (("width", [32, 64]), ("params", [2e5])):
        for head_dim in (16, 24, 32, 48):  # the issue's 16, a divisor of no width, the presets' 32, one above some
            spec = spec_file(tmp_path, archs=[name], size_by=size_by, sizes=sizes, head_dim=head_dim, layers=2,
                             match="params", **data)
            try:
                shapes = plan_shapes(spec)
            except ConfigError as error:
                line = str(error)
                assert "\n" not in line and f"study spec {spec.source}: " in line and "head_dim" in line
                assert "builds at" in line or "takes no head_dim" in line, line
                continue
            for shape in shapes:  # a shape planned is one its model builds with
                assert built(name, shape.init_args, 64, 32)[0] > 0
                assert shape.init_args["n_embd"] % head_dim == 0
