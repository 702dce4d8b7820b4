"""`specrouter distill` on a tiny random target: the fused loss against a dense reference,
the corpus labels against plain forwards, and an end-to-end run with checkpoint and resume."""

from __future__ import annotations

import json

import pytest
import torch
from fixtures import make_tiny_llama

from specrouter.distill.corpus import generate_rows, label_rows
from specrouter.distill.train import distill, projected_embedding, sparse_kl_loss
from specrouter.errors import SpecRouterError

SMALL = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, batch_size=4,
             seq_len=32, lr=1e-2, corpus_tokens=3000, eval_fraction=0.2, eval_every=10,
             checkpoint_every=10, threads=1, progress=False, ce_weight=0.0,
             greedy_eval_tokens=12, draft_vocab_size=100)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    torch.set_num_threads(1)
    return make_tiny_llama(tmp_path_factory.mktemp("target"), vocab_size=320, hidden_size=64,
                           num_layers=2, seed=3)


class _Interrupted(Exception):
    pass


@pytest.fixture(scope="module")
def runs(target, tmp_path_factory):
    """A 30-step run killed right after its step-20 checkpoint then resumed, and the same run
    uninterrupted, on one corpus."""
    import specrouter.distill.train as distill_module

    root = tmp_path_factory.mktemp("distill")
    corpus = root / "corpus"
    save = distill_module._save_checkpoint

    def save_then_die(out, student, opt, step, state):
        save(out, student, opt, step, state)
        if step == 20:
            raise _Interrupted

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(distill_module, "_save_checkpoint", save_then_die)
        with pytest.raises(_Interrupted):
            distill(target, root / "a", steps=30, corpus_dir=corpus, **SMALL)
    resumed = distill(target, root / "a", steps=30, corpus_dir=corpus, **SMALL)
    straight = distill(target, root / "b", steps=30, corpus_dir=corpus, **SMALL)
    return root, resumed, straight


def _dense_reference(hidden, weight, ids, logp, targets, ce_weight):
    logq = torch.log_softmax((hidden.bfloat16() @ weight.bfloat16().T).float(), -1)
    logq_k = logq.gather(1, ids)
    p = logp.float().exp()
    p_tail = (1 - p.sum(-1)).clamp(min=0)
    q_tail = (1 - logq_k.exp().sum(-1)).clamp(min=1e-12)
    kl = (p * (logp.float() - logq_k)).sum() + (p_tail * (p_tail.clamp(min=1e-12).log() - q_tail.log())).sum()
    ce = -logq.gather(1, targets[:, None]).sum()
    return (1 - ce_weight) * kl + ce_weight * ce


@pytest.mark.parametrize("ce_weight", [0.0, 0.3])
def test_sparse_kl_loss_matches_dense_reference(ce_weight):
    g = torch.Generator().manual_seed(0)
    N, V, d, k = 50, 97, 16, 5
    teacher = torch.log_softmax(torch.randn(N, V, generator=g) * 2, -1)
    logp, ids = teacher.topk(k, -1)
    targets = torch.randint(0, V, (N,), generator=g)
    grads = []
    for fn in (sparse_kl_loss, _dense_reference):
        h = torch.randn(N, d, generator=torch.Generator().manual_seed(1)).requires_grad_()
        w = (0.3 * torch.randn(V, d, generator=torch.Generator().manual_seed(2))).requires_grad_()
        loss = (fn(h, w, ids, logp, targets, ce_weight, chunk=16) if fn is sparse_kl_loss
                else fn(h, w, ids, logp, targets, ce_weight))
        loss.backward()
        grads.append((loss.detach(), h.grad, w.grad))
    (l1, gh1, gw1), (l2, gh2, gw2) = grads
    assert torch.allclose(l1, l2, rtol=1e-4)
    # the fused path rounds its logit gradient to bfloat16 before the two matmuls
    assert torch.allclose(gh1, gh2, atol=2e-2 * gh2.abs().max())
    assert torch.allclose(gw1, gw2, atol=2e-2 * gw2.abs().max())


def test_sampled_vocabulary_estimates_the_full_loss():
    g = torch.Generator().manual_seed(0)
    N, V, d, k = 64, 3000, 16, 4
    w = 0.3 * torch.randn(V, d, generator=g)
    h = torch.randn(N, d, generator=g)
    teacher = torch.log_softmax(h @ w.T + 0.5 * torch.randn(N, V, generator=g), -1)
    logp, ids = teacher.topk(k, -1)
    full = sparse_kl_loss(h, w, ids, logp)
    # enough samples for the whole rest: exactly the full loss
    assert torch.allclose(sparse_kl_loss(h, w, ids, logp, vocab_sample=V), full)
    estimates = torch.stack([
        sparse_kl_loss(h, w, ids, logp, vocab_sample=500, generator=torch.Generator().manual_seed(s))
        for s in range(8)])
    assert abs(float(estimates.mean() / full) - 1) < 0.02
    # gradients reach only the used rows of the output embedding, and the hidden states
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    sparse_kl_loss(hh, ww, ids, logp, vocab_sample=100, generator=torch.Generator().manual_seed(0)).backward()
    touched = (ww.grad.abs().sum(-1) > 0).sum()
    assert len(torch.unique(ids)) <= touched <= len(torch.unique(ids)) + 100
    assert hh.grad.abs().sum() > 0


def test_output_basis_init_expresses_the_targets_logits(target):
    from transformers import AutoModelForCausalLM

    from specrouter.distill.train import init_student, output_basis

    model = AutoModelForCausalLM.from_pretrained(str(target)).eval()
    tokens = torch.randint(0, 320, (4, 32), generator=torch.Generator().manual_seed(0))
    basis, rms = output_basis(model, tokens, 64)  # full width: a rotation
    assert torch.allclose(basis.T @ basis, torch.eye(64), atol=1e-4)
    assert bool((rms[:-1] >= rms[1:] - 1e-4).all())
    with torch.no_grad():
        u = model.model(input_ids=tokens).last_hidden_state  # (B, T, D)
        emb = model.get_input_embeddings().weight
        assert torch.allclose((u @ basis) @ (emb @ basis).T, u @ emb.T, atol=1e-3)
    student = init_student(model, init="output", sample_tokens=tokens, hidden_size=32,
                           num_layers=1, num_heads=2, num_kv_heads=1)
    assert torch.allclose(student.get_input_embeddings().weight, emb @ output_basis(model, tokens, 32)[0])
    assert student.lm_head.weight.data_ptr() == student.get_input_embeddings().weight.data_ptr()


def test_projected_embedding_keeps_the_principal_subspace():
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(200, 12, generator=g) @ torch.diag(torch.linspace(3, 0.1, 12))
    full = projected_embedding(emb, 12)  # a rotation: all inner products kept
    assert torch.allclose(full @ full.T, emb @ emb.T, atol=1e-3)
    low = projected_embedding(emb, 4)
    err_low = (low @ low.T - emb @ emb.T).norm()
    rand = emb @ torch.linalg.qr(torch.randn(12, 4, generator=g))[0]
    assert err_low < (rand @ rand.T - emb @ emb.T).norm()  # better than a random projection
    assert projected_embedding(emb, 16)[:, 12:].abs().max() == 0


def test_generated_rows_carry_the_targets_distribution(target):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target)).eval()
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [20, 21, 22, 23]]  # ragged: left padding
    rows = generate_rows(model, prompts, [True, False, True], max_len=24, k=8, temperature=0.7,
                         stop_ids={0}, generator=torch.Generator().manual_seed(0))
    relabelled = label_rows(model, [r[0] for r in rows], 8)
    for (tokens, ids, logp), (ids2, logp2), prompt in zip(rows, relabelled, prompts):
        assert tokens[: len(prompt)] == prompt and len(ids) == len(tokens) - 1
        assert torch.equal(ids, ids2[:-1])
        assert torch.allclose(logp.float(), logp2[:-1].float(), atol=2e-2)
    greedy_tokens, greedy_ids, _ = rows[0]
    assert all(greedy_tokens[t + 1] == int(greedy_ids[t, 0]) for t in range(6, len(greedy_tokens) - 1))


def test_distill_trains_checkpoints_and_reports(runs):
    from transformers import AutoModelForCausalLM

    root, resumed, straight = runs
    out = root / "b"
    losses = [h["loss"] for h in straight.history]
    kls = [h["kl"] for h in straight.history]
    assert [h["step"] for h in straight.history] == [10, 20, 30]
    assert losses[-1] < losses[0] and kls[-1] < kls[0]
    for folder in (out, out / "checkpoint"):
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype="auto")
        assert model.config.vocab_size == 320 and model.config.hidden_size == 32
        assert (folder / "tokenizer.json").is_file()
        assert next(model.parameters()).dtype == (torch.bfloat16 if folder == out else torch.float32)
    recipe = json.loads((out / "recipe.json").read_text())
    assert {"args", "seed", "corpus", "steps_done", "versions", "student_config"} <= recipe.keys()
    assert recipe["steps_done"] == 30 and recipe["args"]["hidden_size"] == 32
    assert {"torch", "transformers", "python"} <= recipe["versions"].keys()
    assert recipe["corpus"]["sources"]["stdlib"]["train_tokens"] > 0
    report = json.loads((out / "report.json").read_text())
    assert {"agreement", "agreement_by_kind", "kl", "params", "wall_time_s", "history",
            "greedy_agreement", "greedy_agreement_by_kind"} <= report.keys()
    assert 0.0 <= report["greedy_agreement"] <= 1.0
    vocab = json.loads((out / "draft_vocab.json").read_text())
    ids = vocab["token_ids"]
    assert 100 <= len(ids) <= 103 and ids == sorted(set(ids)) and 0 <= ids[0] and ids[-1] < 320
    assert 0.0 < vocab["heldout_coverage"] <= 1.0
    from specrouter.models.runners.llama import load_llama_runner

    assert load_llama_runner(out).draft_vocab == ids
    assert set(report["greedy_agreement_by_kind"]) == {"code", "prose", "chat", "extraction"}
    for r in (resumed, straight):
        assert 0.0 <= r.agreement <= 1.0 and r.kl >= 0.0
        assert set(r.agreement_by_kind) <= {"code", "prose", "chat"}
        assert all(0.0 <= a <= 1.0 for a in r.agreement_by_kind.values())
    assert straight.params == sum(p.numel() for p in model.parameters())


def test_resume_continues_from_the_checkpoint(runs):
    from transformers import AutoModelForCausalLM

    root, resumed, straight = runs
    assert (resumed.start_step, resumed.steps) == (20, 30)
    assert (straight.start_step, straight.steps) == (0, 30)
    assert resumed.tokens_seen == straight.tokens_seen
    keys = ("step", "loss", "agreement", "kl", "tokens_seen")  # not the timings
    assert [[h[k] for k in keys] for h in resumed.history] == [[h[k] for k in keys] for h in straight.history]
    # same batches, same optimizer state, same schedule: resuming is exact
    a = AutoModelForCausalLM.from_pretrained(str(root / "a" / "checkpoint")).state_dict()
    b = AutoModelForCausalLM.from_pretrained(str(root / "b" / "checkpoint")).state_dict()
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_resume_refuses_another_shape(target, runs):
    root = runs[0]
    with pytest.raises(SpecRouterError, match="resume=False"):
        distill(target, root / "a", steps=40, corpus_dir=root / "corpus",
                **{**SMALL, "hidden_size": 64, "num_heads": 4})


def test_corpus_build_resumes_and_checks_its_spec(target, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specrouter.distill.corpus import CorpusSpec, build_corpus

    model = AutoModelForCausalLM.from_pretrained(str(target)).eval()
    tok = AutoTokenizer.from_pretrained(str(target))
    spec = CorpusSpec(target=str(target), vocab_size=320, corpus_tokens=2000, generated_fraction=0.5,
                      seq_len=32, teacher_topk=4, temperature=0.7, greedy_fraction=0.5,
                      eval_fraction=0.2, seed=1)
    full = build_corpus(model, tok, tmp_path, spec, progress=False)
    shards = sorted(tmp_path.glob("shard-*.pt"))
    assert int((full.lengths - 1).sum()) >= 2000 and len(shards) >= 3
    kinds = {int(s) for s in full.source}
    assert kinds & {0, 1, 2, 3} and kinds & {4, 5}  # generated and natural rows
    # interrupted after its first shards: the rebuild keeps them and ends with the same rows
    (tmp_path / "done").unlink()
    for p in shards[2:]:
        p.unlink()
    again = build_corpus(model, tok, tmp_path, spec, progress=False)
    assert len(sorted(tmp_path.glob("shard-*.pt"))) == len(shards)
    assert torch.equal(again.source, full.source) and torch.equal(again.is_eval, full.is_eval)
    assert build_corpus(None, None, tmp_path, spec).tokens.shape == again.tokens.shape  # cached
    with pytest.raises(SpecRouterError, match="other settings"):
        build_corpus(None, None, tmp_path, CorpusSpec(**{**spec.__dict__, "seq_len": 64}))


def test_greedy_agreement_scores_the_targets_own_greedy_output(target, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specrouter.distill.evaluate import HELDOUT_PROMPTS, greedy_agreement

    t = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(target))
    other = AutoModelForCausalLM.from_pretrained(
        str(make_tiny_llama(tmp_path / "other", vocab_size=320, hidden_size=64, num_layers=2, seed=9)),
        dtype=torch.float32).eval()
    assert greedy_agreement(t, t, tok, max_new_tokens=10).agreement == 1.0
    rep = greedy_agreement(other, t, tok, max_new_tokens=10, prompts=HELDOUT_PROMPTS[:2])
    # reference: generate token by token with the target, ask the draft at every prefix
    hits = n = 0
    for _, text, _ in HELDOUT_PROMPTS[:2]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        for _ in range(10):
            nxt = int(t(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            hits += int(other(input_ids=torch.tensor([ids])).logits[0, -1].argmax()) == nxt
            n += 1
            ids.append(nxt)
            if nxt == t.generation_config.eos_token_id:
                break
    assert rep.positions == n and rep.agreement == pytest.approx(hits / n) and rep.agreement < 1.0


def test_second_stage_on_two_corpora_starts_from_the_first(target, runs, tmp_path):
    root, _, straight = runs
    other = tmp_path / "corpus-s1"
    distill(target, tmp_path / "s1", steps=10, corpus_dir=other, **{**SMALL, "seed": 1})
    stage2 = distill(target, tmp_path / "stage2", steps=10, corpus_dir=root / "corpus",
                     extra_corpus_dirs=[other], init_from=root / "b", **SMALL)
    recipe = json.loads((tmp_path / "stage2" / "recipe.json").read_text())
    assert recipe["init_from"] == str(root / "b") and recipe["corpus"]["extra_dirs"] == [str(other)]
    # what rebuilds the start and the extra corpus is recorded, not only their paths (review27 N7)
    first = json.loads((root / "b" / "recipe.json").read_text())
    assert recipe["init_from_recipe"] == first and first["init_from_recipe"] is None
    assert recipe["corpus"]["extra_specs"] == [json.loads((other / "spec.json").read_text())]
    assert recipe["corpus"]["extra_specs"][0]["seed"] == 1
    # a run's checkpoint folder gives its run's recipe; a resumed call keeps the first call's record
    from specrouter.distill.train import DistillConfig, _init_from_recipe

    from_ckpt = DistillConfig(target=target, out_dir="o", init_from=root / "b" / "checkpoint")
    assert _init_from_recipe(from_ckpt, tmp_path / "none", resuming=False) == first
    assert _init_from_recipe(from_ckpt, tmp_path / "stage2", resuming=True) == first
    # a warm start: the first evaluation is already near where stage 1 ended, not at a fresh start
    assert stage2.history[0]["kl"] < straight.history[0]["kl"]
    with pytest.raises(SpecRouterError, match="shape"):
        distill(target, tmp_path / "bad", steps=10, corpus_dir=root / "corpus",
                init_from=root / "b", **{**SMALL, "hidden_size": 64})


def test_decontaminate_drops_training_rows_that_start_like_held_out_ones():
    from specrouter.distill.corpus import Corpus

    c = Corpus.__new__(Corpus)
    c.tokens = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 9], [1, 2, 3, 4], [5, 6, 7, 8]])
    c.lengths = torch.tensor([4, 4, 4, 4])
    c.topk_ids = torch.zeros(4, 4, 2, dtype=torch.int32)
    c.topk_logp = torch.zeros(4, 4, 2, dtype=torch.float16)
    c.source = torch.tensor([0, 0, 0, 1])
    c.is_eval = torch.tensor([True, False, False, False])
    assert c.decontaminate(prefix=4) == 1  # row 2 repeats held-out row 0; row 1 only its start
    assert c.tokens.tolist() == [[1, 2, 3, 4], [1, 2, 3, 9], [5, 6, 7, 8]]
    assert c.is_eval.tolist() == [True, False, False] and c.topk_ids.shape[0] == 3


def test_distill_config_is_validated_and_built_from_the_cli_flags(tmp_path):
    import argparse

    from specrouter.cli.distill import config_from_args, register
    from specrouter.distill.train import DistillConfig

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["distill", "--out-dir", str(tmp_path), "--steps", "0", "--seed", "1",
                              "--extra-corpus-dir", "c1", "--extra-corpus-dir", "c2", "--no-resume"])
    cfg = config_from_args("t", args)
    assert (cfg.steps, cfg.seed, cfg.extra_corpus_dirs, cfg.resume) == (0, 1, ("c1", "c2"), False)
    assert cfg == DistillConfig(target="t", out_dir=str(tmp_path), steps=0, seed=1,
                                extra_corpus_dirs=("c1", "c2"), resume=False)
    assert cfg.args()["out_dir"] == str(tmp_path) and cfg.corpus_path == tmp_path / "corpus"
    assert cfg.prompts == "v2" and cfg.corpus_spec(320).prompts == "v2"  # new runs: prompt set v2
    v1 = config_from_args("t", parser.parse_args(["distill", "--out-dir", "o", "--prompts", "v1"]))
    assert v1.corpus_spec(320).prompts == "v1"
    for bad in (dict(save_dtype="int8"), dict(init="random"), dict(batch_size=0), dict(lr=0.0),
                dict(eval_fraction=1.0), dict(ce_weight=1.5), dict(steps=-1), dict(prompts="v3")):
        with pytest.raises(SpecRouterError):
            DistillConfig(target="t", out_dir="o", **bad)
