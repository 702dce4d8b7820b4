// The penalties of decoding/processors.py (repetition, frequency, presence) for every penalized
// row at every position, natively and in place, in ONE call per step: what `penalty_columns` and
// `penalize` do with ~20 numpy / torch calls (each ~5-30 us with the caches a model forward left
// cold: ~100-150 us a step for one row), from each row's committed history as its PenaltyMemo
// keeps it (distinct tokens, in the prompt or not, generated counts: torch views of the memo's
// arrays, no copy) and its draft path. Only the history's columns are read and written: a few
// hundred values per position, not the vocabulary. The same float operations in the same dtype
// and order as `penalize` (bit for bit: tests/test_processors_fast.py against the per-position
// reference).
//
// Row r: logits row brow[r]; committed columns j < sizes[r] (token cols[r][j]); path tokens
// path[i] (i < offset + G - 1), token i counting from position i - offset + 1 on (before the
// row's first position: at every position); a path token not committed gets a column of its own
// (not in the prompt, count 0). Per column and position g:
//   count = (T) (counts[j] + the path tokens before position 0) + the later path tokens up to g
//   present = count > 0
//   repetition r != 1: x = (in_prompt | present) ? (x > 0 ? x / r : x * r) : x
//   frequency f != 0:  x = x - f * count   (the product rounded, then the difference)
//   presence p != 0:   x = x - p * present
// r, f, p in T (the logits' dtype).

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#pragma GCC optimize("fp-contract=off")  // x - f * count: the product rounded before the difference

namespace {

struct Column {
  int64_t token;
  bool in_prompt;
  double base;                  // counts + the path tokens before position 0
  std::vector<int64_t> firsts;  // positions from which each later path token counts
};

template <typename T>
void apply(T* x, int64_t G, int64_t V, const Column& c, T r, T f, T p) {
  const bool rep = r != T(1), freq = f != T(0), pres = p != T(0);
  const T base = static_cast<T>(c.base);
  for (int64_t g = 0; g < G; ++g) {
    T count = base;
    for (int64_t first : c.firsts)
      if (first <= g) count += T(1);
    const bool present = count > T(0);
    T& v = x[g * V + c.token];
    T y = v;
    if (rep && (c.in_prompt || present)) y = y > T(0) ? y / r : y * r;
    if (freq) {
      const T d = f * count;
      y = y - d;
    }
    if (pres) {
      const T d = p * (present ? T(1) : T(0));
      y = y - d;
    }
    v = y;
  }
}

void penalize_rows(at::Tensor logits, at::IntArrayRef brow, at::TensorList cols, at::TensorList in_prompt,
                   at::TensorList counts, at::IntArrayRef sizes, at::IntArrayRef path, at::IntArrayRef path_start,
                   at::IntArrayRef offsets, at::ArrayRef<double> presence, at::ArrayRef<double> frequency,
                   at::ArrayRef<double> repetition) {
  TORCH_CHECK(logits.dim() == 3 && logits.is_contiguous() && logits.device().is_cpu(),
              "logits: (B, G, V) contiguous on the CPU");
  const auto dt = logits.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kDouble, "penalize_rows: float32 or float64 logits");
  const int64_t R = static_cast<int64_t>(brow.size()), B = logits.size(0), G = logits.size(1), V = logits.size(2);
  TORCH_CHECK(static_cast<int64_t>(cols.size()) == R && static_cast<int64_t>(in_prompt.size()) == R
              && static_cast<int64_t>(counts.size()) == R && static_cast<int64_t>(sizes.size()) == R
              && static_cast<int64_t>(path_start.size()) == R + 1 && static_cast<int64_t>(offsets.size()) == R
              && static_cast<int64_t>(presence.size()) == R && static_cast<int64_t>(frequency.size()) == R
              && static_cast<int64_t>(repetition.size()) == R, "penalize_rows: one entry per row");
  TORCH_CHECK(path_start[R] == static_cast<int64_t>(path.size()), "path_start: the path's bounds");
  thread_local std::vector<int32_t> mark;  // token -> its path column + 1 (0: none); reset after each row
  if (static_cast<int64_t>(mark.size()) < V) mark.assign(V, 0);
  std::vector<Column> extra;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t b = brow[r], n = sizes[r];
    TORCH_CHECK(b >= 0 && b < B, "brow: row ", b, " out of ", B);
    const at::Tensor &ct = cols[r], &pt = in_prompt[r], &nt = counts[r];
    TORCH_CHECK(ct.scalar_type() == at::kLong && ct.is_contiguous() && ct.numel() >= n && pt.scalar_type() == at::kBool
                && pt.is_contiguous() && pt.numel() >= n && nt.scalar_type() == at::kDouble && nt.is_contiguous()
                && nt.numel() >= n, "cols, in_prompt, counts: int64, bool, float64 contiguous, sizes[r] at least");
    const int64_t* tok = ct.data_ptr<int64_t>();
    const bool* inp = pt.data_ptr<bool>();
    const double* cnt = nt.data_ptr<double>();
    // the path's distinct tokens as columns (their committed column found below)
    extra.clear();
    std::vector<int64_t> committed_of;  // per extra column: its committed column, or -1
    for (int64_t i = path_start[r]; i < path_start[r + 1]; ++i) {
      const int64_t t = path[i], first = (i - path_start[r]) - offsets[r] + 1;
      TORCH_CHECK(t >= 0 && t < V, "path: token ", t, " out of the vocabulary");
      if (!mark[t]) {
        extra.push_back({t, false, 0.0, {}});
        committed_of.push_back(-1);
        mark[t] = static_cast<int32_t>(extra.size());
      }
      Column& c = extra[mark[t] - 1];
      if (first <= 0)
        c.base += 1.0;
      else
        c.firsts.push_back(first);
    }
    if (!extra.empty())
      for (int64_t j = 0; j < n; ++j) {
        TORCH_CHECK(tok[j] >= 0 && tok[j] < V, "cols: token ", tok[j], " out of the vocabulary");
        if (mark[tok[j]]) committed_of[mark[tok[j]] - 1] = j;
      }
    for (const Column& c : extra) mark[c.token] = 0;
    auto run = [&](auto* x) {
      using T = std::remove_pointer_t<decltype(x)>;
      const T rp = static_cast<T>(repetition[r]), fp = static_cast<T>(frequency[r]), pp = static_cast<T>(presence[r]);
      if (rp == T(1) && fp == T(0) && pp == T(0)) return;
      T* row = x + b * G * V;
      std::vector<int8_t> has_path(n, 0);
      for (size_t e = 0; e < extra.size(); ++e) {
        Column c = extra[e];
        const int64_t j = committed_of[e];
        if (j >= 0) {
          c.in_prompt = inp[j];
          c.base += cnt[j];
          has_path[j] = 1;
        }
        apply(row, G, V, c, rp, fp, pp);
      }
      Column c{0, false, 0.0, {}};
      for (int64_t j = 0; j < n; ++j) {
        if (has_path[j]) continue;
        TORCH_CHECK(tok[j] >= 0 && tok[j] < V, "cols: token ", tok[j], " out of the vocabulary");
        c.token = tok[j];
        c.in_prompt = inp[j];
        c.base = cnt[j];
        apply(row, G, V, c, rp, fp, pp);
      }
    };
    if (dt == at::kFloat)
      run(logits.data_ptr<float>());
    else
      run(logits.data_ptr<double>());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specrouter_rowinv, m) {
  m.def("penalize_rows(Tensor(a!) logits, int[] brow, Tensor[] cols, Tensor[] in_prompt, Tensor[] counts, int[] sizes, "
        "int[] path, int[] path_start, int[] offsets, float[] presence, float[] frequency, float[] repetition) -> ()");
}

TORCH_LIBRARY_IMPL(specrouter_rowinv, CPU, m) { m.impl("penalize_rows", &penalize_rows); }
