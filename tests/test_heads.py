"""The EAGLE-style draft head (heads/): the runner's features, the head's shapes and vocabulary,
its unrolled training forward against step-by-step drafting on the native kernels, the
acceptance arithmetic on a hand-computed case, training (loss goes down, resume = straight run)
and a negative control (shuffled features agree less). Tiny random targets, no downloads."""

from __future__ import annotations

import json

import pytest
import torch
from fixtures import make_tiny_llama, make_tiny_tokenizer
from test_row_invariance import SMOLLM2_135M, random_runner

from specrouter.distill.corpus import SOURCE_IDS, Corpus
from specrouter.heads.evaluate import (
    acceptance_stats,
    draft_hits,
    greedy_starts,
    head_hits,
)
from specrouter.models.heads.model import (
    EagleHead,
    HeadConfig,
    frequent_tokens,
    load_head,
    save_head,
)
from specrouter.models.heads.runner import HeadRunner, load_head_runner
from specrouter.models.runners.base import ForwardBatch
from specrouter.models.runners.llama import load_llama_runner, read_checkpoint


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    torch.set_num_threads(1)
    return make_tiny_llama(tmp_path_factory.mktemp("head-target"), vocab_size=320, hidden_size=64,
                           num_layers=2, seed=3, tie_word_embeddings=False)


def _head(target, vocab_ids=None, seed=0):
    config, _arch, tensors = read_checkpoint(target)
    ids = tuple(vocab_ids if vocab_ids is not None else range(0, config["vocab_size"], 3))
    head = EagleHead(HeadConfig(target_config=config, vocab_ids=ids), tensors)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # away from the [I | I] / last-layer init, so every tensor matters
        for p in head.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return head, tensors


# ---- the runner's features ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_features_are_the_same_for_a_step_a_prefill_and_a_ragged_batch(dtype):
    runner = random_runner(SMOLLM2_135M, dtype, num_slots=3, max_len=64, num_layers=2)
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, runner.vocab_size, (20,), generator=g).tolist()
    other = torch.randint(0, runner.vocab_size, (7,), generator=g).tolist()
    steps = []
    for i, tok in enumerate(seq):  # plain decoding, one token at a time
        logits, f = runner.forward_with_features(ForwardBatch.build([0], [i], [[tok]], [[0]]))
        steps.append(f[0, 0].clone())
    steps = torch.stack(steps)  # (20, H)
    assert steps.dtype == dtype and steps.shape == (20, 576)
    logits, prefill = runner.forward_with_features(ForwardBatch.build([1], [0], [seq], [list(range(20))]))
    assert torch.equal(prefill[0], steps)
    # logits unchanged by asking for features: the same as forward()
    assert torch.equal(logits, runner.forward(ForwardBatch.build([1], [0], [seq], [list(range(20))])))
    # a ragged batch: this row's last 5 tokens after 15 cached, beside another row
    _, ragged = runner.forward_with_features(
        ForwardBatch.build([2, 1], [0, 15], [other, seq[15:]], [[0], [0]]))
    assert torch.equal(ragged[1, :5], steps[15:])
    assert torch.equal(runner.final_norm(steps), runner.final_norm(prefill[0]))


# ---- the head ----------------------------------------------------------------------------------
def test_head_shapes_and_reduced_vocabulary(target):
    head, tensors = _head(target)
    V, H = 320, 64
    ids = head.vocab_ids
    assert head.head_rows.shape == (len(ids), H)
    assert torch.equal(head.head_rows, tensors["lm_head.weight"][ids].float())  # untied: the lm_head's rows
    assert torch.equal(head.vocab_ids[head.vocab_index[ids]], ids)  # target id -> index -> target id
    assert int((head.vocab_index >= 0).sum()) == len(ids) and int(head.vocab_index[1]) == -1
    feats, tokens = torch.randn(2, 9, H), torch.randint(0, V, (2, 9))
    outs = head.unrolled(feats, tokens, levels=3)
    assert len(outs) == 3 and all(o.shape == (2, 8, H) for o in outs)
    assert head.logits(outs[0]).shape == (2, 8, len(ids))
    # depth 1 does not read the depth-2 inputs: unrolling more levels leaves it alone
    assert torch.allclose(head.unrolled(feats, tokens, levels=1)[0], outs[0], atol=1e-6)
    # trained tensors: fc and one layer of the target's shape, nothing frozen among them
    names = set(head.head_tensors())
    assert "fc.weight" in names and all(n == "fc.weight" or n.startswith("layers.0.") for n in names)
    assert head.head_tensors()["fc.weight"].shape == (H, 2 * H)


def test_frequent_tokens_by_count_then_id():
    tokens = torch.tensor([5, 5, 5, 2, 2, 9, 7, 7])
    assert frequent_tokens(tokens, 12, 2) == [2, 5]
    assert frequent_tokens(tokens, 12, 3) == [2, 5, 7]
    assert frequent_tokens(tokens, 12, 4, always=(11,)) == [2, 5, 7, 9, 11]
    assert frequent_tokens(tokens, 12, 5) == [0, 2, 5, 7, 9]  # unseen ones: lowest id first


@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_unrolled_training_forward_equals_drafting_step_by_step(target, kernels, tmp_path):
    """Depth j of `unrolled` is what the runner computes drafting j steps from the true features."""
    head, _ = _head(target)
    save_head(tmp_path / "h", head, dtype=torch.float32)
    runner = load_head_runner(tmp_path / "h", target, dtype=torch.float32, max_len=32, kernels=kernels)
    tgt = load_llama_runner(target, dtype=torch.float32, max_len=32, kernels=kernels)
    toks = torch.randint(0, 320, (16,), generator=torch.Generator().manual_seed(1)).tolist()
    _, f = tgt.forward_with_features(ForwardBatch.build([0], [0], [toks], [[0]]))  # (1, 16, H)
    outs = head.unrolled(f.float(), torch.tensor([toks]), levels=3)
    n = len(toks) - 1
    logits, g = runner.step(ForwardBatch.build([0], [0], [toks[1:]], [list(range(n))]), f[:, :n])
    assert torch.allclose(g[0], outs[0][0], atol=1e-4)
    inside = list(head.config.vocab_ids)
    assert torch.allclose(logits[0][:, inside], head.logits(outs[0][0]), atol=1e-4)
    assert bool(torch.isinf(logits[0][:, 1]).all())  # outside the reduced vocabulary
    s, fed = 6, f[:, 6:7]
    for j in range(1, 4):  # the chain from s: re-writes positions s.. of the head's cache
        _, fed = runner.step(ForwardBatch.build([0], [s + j - 1], [[toks[s + j]]], [[0]]), fed)
        assert torch.allclose(fed[0, 0], outs[j - 1][0, s + j - 1], atol=1e-4), f"depth {j}"
    # save / load round trip: the same tensors
    loaded = load_head(tmp_path / "h", target)
    for name, t in head.head_tensors().items():
        assert torch.equal(loaded.head_tensors()[name], t)
    assert isinstance(runner, HeadRunner)


# ---- evaluation arithmetic ---------------------------------------------------------------------
def test_acceptance_stats_hand_computed():
    hits = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 1, 1], [1, 1, 1]], dtype=torch.bool)
    by_depth, lengths = acceptance_stats(hits)
    # depth 1: 3 of 4; depth 2: of those 3, rows 0 and 3 (2/3); depth 3: of those 2, row 3 (1/2)
    assert by_depth == pytest.approx([0.75, 2 / 3, 0.5])
    # accepted per chain for k=3: 2, 1, 0, 3 -> lengths 3, 2, 1, 4
    assert lengths == pytest.approx({1: 1.75, 2: 1 + (2 + 1 + 0 + 2) / 4, 3: 2.5})


def test_chain_hits_hand_computed():
    tokens = torch.tensor([9, 1, 2, 3, 4, 5, 6])
    labels = torch.tensor([1, 2, 3, 8, 5, 6, 0])  # greedy token at t; position 3's is not the text's
    assert greedy_starts(tokens, labels, 7, 2).tolist() == [0, 1, 4]
    # a standalone draft: argmax at each position given the text
    preds = torch.tensor([1, 2, 0, 8, 5, 6, 0])
    starts = torch.tensor([0, 1, 4])
    # depth j of start s: preds[s+j] == labels[s+j]
    assert draft_hits(preds, labels, starts, 2).tolist() == [[True, False], [False, True], [True, True]]
    # a head: level j at position s+j-1 against labels[s+j]
    hp = torch.zeros(2, 6, dtype=torch.long)
    hp[0] = torch.tensor([2, 3, 7, 5, 6, 0])  # level 1 at t predicts labels[t+1]
    hp[1] = torch.tensor([0, 3, 8, 0, 0, 1])  # level 2 at t predicts labels[t+1] two steps in
    assert head_hits(hp, labels, starts).tolist() == [[True, True], [True, True], [True, False]]


# ---- training ----------------------------------------------------------------------------------
def _tiny_corpus(target, folder, rows: int = 24, T: int = 24, k: int = 4) -> Corpus:
    """Rows the tiny target continues greedily from random 4-token prompts, with its top-k, as a
    finished corpus folder (every 4th row held out)."""
    runner = load_llama_runner(target, dtype=torch.float32, max_len=64, kernels="torch")
    g = torch.Generator().manual_seed(0)
    shard = {"tokens": torch.zeros(rows, T, dtype=torch.long), "lengths": torch.full((rows,), T),
             "topk_ids": torch.zeros(rows, T, k, dtype=torch.int32),
             "topk_logp": torch.full((rows, T, k), -100.0, dtype=torch.float16),
             "source": torch.full((rows,), SOURCE_IDS["gen-chat"]), "is_eval": torch.arange(rows) % 4 == 0}
    for r in range(rows):
        seq = torch.randint(3, 320, (4,), generator=g).tolist()
        while len(seq) < T:
            logits = runner.forward(ForwardBatch.build([0], [0], [seq], [[len(seq) - 1]]))[0, 0]
            seq.append(int(logits.argmax()))
        logits = runner.forward(ForwardBatch.build([0], [0], [seq], [list(range(T))]))[0]  # (T, V)
        lp, ids = torch.log_softmax(logits, -1).topk(k, -1)
        shard["tokens"][r] = torch.tensor(seq)
        shard["topk_ids"][r, : T - 1], shard["topk_logp"][r, : T - 1] = ids[:-1].int(), lp[:-1].half()
    folder.mkdir(parents=True)
    torch.save(shard, folder / "shard-00000.pt")
    (folder / "spec.json").write_text(json.dumps({"vocab_size": 320, "seq_len": T, "teacher_topk": k}))
    (folder / "done").touch()
    return Corpus([shard])


SMALL = {"vocab_size": 200, "batch_size": 4, "lr": 3e-3, "unroll": 2, "eval_every": 20,
         "checkpoint_every": 20, "eval_depth": 3, "seq_len": 24, "dtype": "float32", "threads": 1,
         "progress": False}


class _Interrupted(Exception):
    pass


@pytest.fixture(scope="module")
def runs(target, tmp_path_factory):
    """A 60-step run killed after its step-40 checkpoint and resumed, and the same run straight."""
    import specrouter.heads.train as head_train

    root = tmp_path_factory.mktemp("head-train")
    _tiny_corpus(target, root / "corpus")
    common = dict(target=target, corpus_dir=root / "corpus", features_dir=root / "features", steps=60, **SMALL)
    save = head_train._save_checkpoint

    def save_then_die(out, head, opt, step, state):
        save(out, head, opt, step, state)
        if step == 40:
            raise _Interrupted

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(head_train, "_save_checkpoint", save_then_die)
        with pytest.raises(_Interrupted):
            head_train.run_head_distill(head_train.HeadDistillConfig(out_dir=root / "a", **common))
    resumed = head_train.run_head_distill(head_train.HeadDistillConfig(out_dir=root / "a", **common))
    straight = head_train.run_head_distill(head_train.HeadDistillConfig(out_dir=root / "b", **common))
    return root, resumed, straight


def test_training_lowers_the_loss_and_resume_equals_a_straight_run(runs, target):
    root, resumed, straight = runs
    assert resumed.start_step == 40 and straight.start_step == 0 and resumed.steps == straight.steps == 60
    h = straight.history
    assert [e["step"] for e in h] == [20, 40, 60]
    assert h[-1]["loss"] < h[0]["loss"]
    a, b = load_head(root / "a" / "checkpoint", target), load_head(root / "b" / "checkpoint", target)
    for name, t in b.head_tensors().items():
        assert torch.equal(a.head_tensors()[name], t), name
    assert resumed.head == straight.head
    for f in ("head.safetensors", "head_config.json", "recipe.json", "report.json"):
        assert (root / "b" / f).is_file(), f
    rep = json.loads((root / "b" / "report.json").read_text())
    assert rep["head"]["chains"] > 0 and len(rep["head"]["agreement_by_depth"]) == 3
    assert rep["head_step_ms"] > 0 and rep["vocab_size"] <= 200 + 3
    # the head on the runner's kernels agrees like its training forward (both float32 here)
    assert abs(rep["head"]["extra"]["native_depth1_agreement"] - rep["head"]["agreement"]) < 0.03


def test_shuffled_features_agree_less(runs, target):
    """Negative control: the trained head reads the target's features; fed the features of
    other positions it agrees with the target less."""
    from specrouter.heads.evaluate import drafter_report, head_predictions
    from specrouter.heads.features import compute_features

    root, _, _ = runs
    head = load_head(root / "b" / "checkpoint", target)
    corpus = Corpus([torch.load(root / "corpus" / "shard-00000.pt")])
    runner = load_llama_runner(target, dtype=torch.float32, num_slots=4, max_len=64)
    feats = compute_features(runner, corpus, root / "features", progress=False)
    rows = torch.arange(len(corpus.tokens))
    g = torch.Generator().manual_seed(0)

    def preds(r, shuffle):
        L = int(corpus.lengths[r])
        f = feats.features[r, :L]
        if shuffle:
            f = f[torch.randperm(L, generator=g)]
        return head_predictions(head, f, corpus.tokens[r, :L], 1)

    true = drafter_report(lambda r: preds(r, False), corpus, feats.labels, rows, 1, head=True)
    shuffled = drafter_report(lambda r: preds(r, True), corpus, feats.labels, rows, 1, head=True)
    assert true.agreement > shuffled.agreement + 0.1, (true.agreement, shuffled.agreement)


def test_head_config_from_the_cli_flags(tmp_path):
    import argparse

    from specrouter.cli.distill import head_config_from_args, register
    from specrouter.errors import SpecRouterError
    from specrouter.heads.train import HeadDistillConfig

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["distill", "--head", "--out-dir", str(tmp_path), "--steps", "5",
                              "--unroll", "3", "--compare-draft", ""])
    cfg = head_config_from_args("t", args)
    assert cfg == HeadDistillConfig(target="t", out_dir=str(tmp_path), steps=5, unroll=3)
    assert cfg.corpus_tokens == 150_000 and cfg.lr == 1e-3 and cfg.compare_draft is None
    for bad in ({"unroll": 0}, {"lr": 0.0}, {"save_dtype": "int8"}, {"steps": -1}, {"ce_weight": 2.0},
                {"prompts": "v3"}):
        with pytest.raises(SpecRouterError):
            HeadDistillConfig(target="t", out_dir="o", **bad)


def test_head_corpus_uses_the_prompt_set_given(tmp_path, monkeypatch):
    """--prompts reaches a head's own corpus (review27 N3: it was dropped); v1 by default, the
    set the shipped head was built with."""
    import argparse

    from specrouter.cli.distill import head_config_from_args, register
    from specrouter.heads import generate
    from specrouter.heads import train as head_train

    make_tiny_tokenizer(tmp_path / "t")
    specs = []

    def record(runner, tokenizer, spec, *a, **kw):
        specs.append(spec)
        raise InterruptedError  # stop before anything is generated

    monkeypatch.setattr(generate, "generate_corpus", record)
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    for flags, want in (([], "v1"), (["--prompts", "v2"], "v2")):
        args = parser.parse_args(["distill", "--head", "--out-dir", str(tmp_path / "o"), *flags])
        with pytest.raises(InterruptedError):
            head_train._load_corpus(head_config_from_args(tmp_path / "t", args), 320, None)
        assert specs[-1].prompts == want


def test_generated_corpus_carries_the_runners_features_and_labels(target, tmp_path):
    """heads/generate.py: rows the target writes in batched 1-token steps carry the features and
    greedy labels a whole-row forward computes (row invariance), and greedy rows follow them."""
    from transformers import AutoTokenizer

    from specrouter.distill.corpus import CorpusSpec, load_corpus
    from specrouter.heads.features import compute_features
    from specrouter.heads.generate import generate_corpus

    runner = load_llama_runner(target, dtype=torch.float32, num_slots=32, max_len=64)
    spec = CorpusSpec(target=str(target), vocab_size=320, corpus_tokens=300, generated_fraction=1.0,
                      seq_len=40, teacher_topk=4, temperature=0.7, greedy_fraction=0.5, eval_fraction=0.2,
                      seed=0)
    generate_corpus(runner, AutoTokenizer.from_pretrained(str(target)), spec, tmp_path / "c", tmp_path / "f",
                    progress=False)
    corpus = load_corpus(tmp_path / "c")
    made = compute_features(runner, corpus, tmp_path / "f", progress=False)  # loads the generated shards
    again = compute_features(runner, corpus, tmp_path / "f2", progress=False)  # whole-row forwards
    for r in range(len(corpus.tokens)):
        L = int(corpus.lengths[r])
        assert torch.equal(made.features[r, : L - 1], again.features[r, : L - 1])
        assert torch.equal(made.labels[r, : L - 1], again.labels[r, : L - 1]) and int(made.labels[r, L - 1]) == -1
        assert torch.equal(corpus.topk_ids[r, : L - 1, 0].long(), made.labels[r, : L - 1])
    # past the prompts (at most 10 tokens at seq_len 40) greedy rows follow their labels
    follows = [bool((corpus.tokens[r, 11 : int(corpus.lengths[r])]
                     == made.labels[r, 10 : int(corpus.lengths[r]) - 1]).all()) for r in range(len(corpus.tokens))]
    assert any(follows) and not all(follows)  # greedy rows follow the labels, sampled ones do not


def test_native_chains_equal_the_unrolled_evaluation(target, tmp_path):
    """The engine-side drafting (HeadRunner, slots side by side, starts in decreasing order)
    scores the same chains as the unrolled training forward (float32, tiny target)."""
    from specrouter.heads.evaluate import head_predictions, native_chain_hits

    head, _ = _head(target)
    save_head(tmp_path / "h", head, dtype=torch.float32)
    hr = load_head_runner(tmp_path / "h", target, dtype=torch.float32, num_slots=4, max_len=64)
    tgt = load_llama_runner(target, dtype=torch.float32, max_len=64)
    toks = torch.randint(0, 320, (30,), generator=torch.Generator().manual_seed(2))
    _, f = tgt.forward_with_features(ForwardBatch.build([0], [0], [toks.tolist()], [list(range(30))]))
    labels = head.vocab_ids[head.logits(head.unrolled(f.float(), toks[None], 1)[0][0]).argmax(-1)]  # head's own
    labels = torch.cat([labels[:1], labels])  # (30,): make depth-1 hits likely, so deeper depths are reached
    starts = torch.arange(0, 30 - 4)
    preds = head_predictions(head, f[0], toks, 4)
    assert torch.equal(native_chain_hits(hr, toks, f[0], labels, starts, 4, slots=4), head_hits(preds, labels, starts))
