"""Per-token mask cost of the grammar engines on PyPI, on this CPU, with the default target's
tokenizer (SmolLM2, 49,152 tokens): how issue 30's engine was picked (docs/structured-output.md).

For each engine installed (llguidance, xgrammar, outlines-core; missing ones are skipped), one
JSON schema is compiled, then a valid JSON document's tokens are walked: at every position the
next-token mask is computed and the token consumed (median microseconds per token), then a
speculative pass: advance along 8 tokens computing each mask, roll back 8 (microseconds per
drafted position). Run: `python benchmarks/grammar_engines.py [TOKENIZER_DIR]`.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "status": {"enum": ["active", "inactive", "pending"]},
    },
    "required": ["name", "age", "email", "tags", "address", "status"],
    "additionalProperties": False,
}
DOC = json.dumps({"name": "Ada Lovelace", "age": 36, "email": "ada@example.org",
                  "tags": ["math", "engines", "poetry"], "address": {"city": "London", "zip": "W1"},
                  "status": "active"})
DRAFT = 8


def tokenizer_dir() -> str:
    if len(sys.argv) > 1:
        return sys.argv[1]
    from specrouter.models.gguf_convert import default_target_dir
    return str(default_target_dir(progress=False))


def bench_llguidance(hf, tokens):
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt
    t0 = time.perf_counter()
    tok = llguidance.hf.from_tokenizer(hf)
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    m = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA))
    t_compile = time.perf_counter() - t0
    mask = lt.allocate_token_bitmask(1, tok.vocab_size)
    step = []
    for t in tokens:
        t0 = time.perf_counter()
        lt.fill_next_token_bitmask(m, mask, 0)
        ok = m.consume_token(t)
        step.append(time.perf_counter() - t0)
        assert ok, m.get_error()
    spec = []
    m.reset()
    for i in range(0, len(tokens) - DRAFT, DRAFT):
        t0 = time.perf_counter()
        for t in tokens[i:i + DRAFT]:
            lt.fill_next_token_bitmask(m, mask, 0)
            m.consume_token(t)
        m.rollback(DRAFT)
        spec.append((time.perf_counter() - t0) / DRAFT)
        m.consume_tokens(tokens[i:i + DRAFT])
    return t_tok, t_compile, step, spec


def bench_xgrammar(hf, tokens):
    import torch
    import xgrammar as xgr
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf))
    comp = xgr.GrammarCompiler(info, max_threads=1)
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    cg = comp.compile_json_schema(json.dumps(SCHEMA))
    t_compile = time.perf_counter() - t0
    m = xgr.GrammarMatcher(cg, max_rollback_tokens=DRAFT)
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    step = []
    for t in tokens:
        t0 = time.perf_counter()
        m.fill_next_token_bitmask(mask)
        ok = m.accept_token(t)
        step.append(time.perf_counter() - t0)
        assert ok
    spec = []
    m.reset()
    for i in range(0, len(tokens) - DRAFT, DRAFT):
        t0 = time.perf_counter()
        for t in tokens[i:i + DRAFT]:
            m.fill_next_token_bitmask(mask)
            m.accept_token(t)
        m.rollback(DRAFT)
        spec.append((time.perf_counter() - t0) / DRAFT)
        for t in tokens[i:i + DRAFT]:
            m.accept_token(t)
    del torch
    return t_tok, t_compile, step, spec


def bench_outlines(hf, tokens):
    import torch
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema
    t0 = time.perf_counter()
    eos = hf.eos_token_id
    vocab: dict[str, list[int]] = {}
    for i in range(len(hf)):
        if i != eos and i not in hf.all_special_ids:
            vocab.setdefault(hf.decode([i]), []).append(i)
    voc = Vocabulary(eos, vocab)
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    index = Index(build_regex_from_schema(json.dumps(SCHEMA), r"[ ]?"), voc)
    t_compile = time.perf_counter() - t0
    g = Guide(index, max_rollback=DRAFT)
    mask = torch.zeros((len(hf) + 31) // 32, dtype=torch.int32)
    step = []
    for t in tokens:
        t0 = time.perf_counter()
        g.write_mask_into(mask.data_ptr(), mask.numel(), 4)
        g.advance(t)
        step.append(time.perf_counter() - t0)
    spec = []
    g.reset()
    for i in range(0, len(tokens) - DRAFT, DRAFT):
        t0 = time.perf_counter()
        for t in tokens[i:i + DRAFT]:
            g.write_mask_into(mask.data_ptr(), mask.numel(), 4)
            g.advance(t)
        g.rollback_state(DRAFT)
        spec.append((time.perf_counter() - t0) / DRAFT)
        for t in tokens[i:i + DRAFT]:
            g.advance(t)
    return t_tok, t_compile, step, spec


def main() -> None:
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(tokenizer_dir())
    tokens = hf.encode(DOC, add_special_tokens=False)
    print(f"vocabulary {len(hf)}, document {len(tokens)} tokens, draft {DRAFT}")
    for name, fn in (("llguidance", lambda: bench_llguidance(hf, tokens)),
                     ("xgrammar", lambda: bench_xgrammar(hf, tokens)),
                     ("outlines-core", lambda: bench_outlines(hf, tokens))):
        try:
            t_tok, t_compile, step, spec = fn()
        except ImportError as e:
            print(f"{name:14s} not installed ({e})")
            continue
        except Exception as e:  # an engine that cannot run this schema says so
            print(f"{name:14s} failed: {type(e).__name__}: {str(e)[:200]}")
            continue
        med = statistics.median(step) * 1e6
        p90 = sorted(step)[int(0.9 * len(step))] * 1e6
        sp = f"{statistics.median(spec) * 1e6:8.1f}" if spec else "     n/a"
        print(f"{name:14s} tokenizer {t_tok * 1e3:7.0f} ms  schema {t_compile * 1e3:7.1f} ms  "
              f"mask+consume median {med:7.1f} us p90 {p90:7.1f} us  draft+rollback {sp} us/pos")


if __name__ == "__main__":
    main()
