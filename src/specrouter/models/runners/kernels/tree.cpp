// The host work of a token-tree cycle (docs/trees.md), natively:
//
// `topk_rows(x (R, V) float32, k) -> (values (R, k), indices (R, k) int64)`: torch.topk(x, k)
// (largest, sorted) bit for bit, ties included, in one pass of AVX2 compares. torch's CPU topk
// (ATen/native/TopKImpl.h `topk_impl_loop`) copies each row into a vector of (double value,
// index) pairs and, where k * 64 <= V, runs std::partial_sort with the comparator "NaN first,
// then greater": a heap of the first k pairs, then every later pair that compares before the
// heap's top replaces it (`__pop_heap`), then `sort_heap`. Its order among equal values is that
// heap's, not the index order, so a faster top-k must replay it: here the heap is the same
// (std::make_heap / pop_heap / sort_heap over the same pairs and comparator), and the pairs
// that do not compare before the top (almost all of a vocabulary) are skipped 8 at a time by
// a vector compare against the top's value (x > top, or x NaN), which is exactly the
// condition under which partial_sort would have touched them. ~6 us a row of 49k against
// torch's ~80 us (tree drafting ranks every expanded node's children this way,
// decoding/tree_drafting.py). Where k * 64 > V (torch's nth_element path) the caller keeps
// torch.topk.
//
// `move_kv(k_caches, v_caches, slot, start, nodes)`: ModelRunner.move_kv on the native caches
// (L tensors (S, KV, P, D) each): the accepted branch's K and V rows from start + nodes[i] to
// start + i, in increasing i (nodes increase and nodes[i] >= i: nothing is read after it is
// overwritten), one memcpy per (layer, kv head, moved node): the same bytes as the torch
// gather/scatter, in one call instead of two indexing ops per layer.

#include <ATen/ATen.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <utility>
#include <vector>

namespace {

using Elem = std::pair<double, int64_t>;  // torch's queue element: (acc_type<float> = double, index)

inline bool before(const Elem& x, const Elem& y) {  // TopKImpl.h's comparator for largest=true
  return (std::isnan(x.first) && !std::isnan(y.first)) || (x.first > y.first);
}

// one row: torch's partial_sort(queue, queue + k, queue + V, before), replayed
void topk_row(const float* x, int64_t V, int64_t k, float* values, int64_t* indices) {
  std::vector<Elem> heap(k + 1);  // the heap in [0, k); slot k: the candidate pop_heap takes in
  for (int64_t j = 0; j < k; ++j) heap[j] = Elem(x[j], j);
  std::make_heap(heap.begin(), heap.begin() + k, before);
  auto offer = [&](int64_t i) {  // __heap_select's step: if comp(*i, *first) __pop_heap(first, middle, i)
    Elem c(x[i], i);
    if (before(c, heap[0])) {
      heap[k] = c;  // pop_heap over k + 1 = __pop_heap(first, first + k, first + k): the candidate sifts in
      std::pop_heap(heap.begin(), heap.begin() + k + 1, before);
    }
  };
  int64_t i = k;
  for (; i < V && (i & 7); ++i) offer(i);  // to an 8-aligned index (x's rows need not be aligned: loadu)
  for (; i + 8 <= V; i += 8) {
    const __m256 top = _mm256_set1_ps(static_cast<float>(heap[0].first));  // exact: a float's value
    const __m256 v = _mm256_loadu_ps(x + i);
    // lanes that may compare before the top: not <= it (greater, or a NaN either side);
    // `before` decides exactly, lane by lane, in index order
    const int mask = _mm256_movemask_ps(_mm256_cmp_ps(v, top, _CMP_NLE_UQ));
    if (mask) {
      for (int l = 0; l < 8; ++l)
        if (mask & (1 << l)) offer(i + l);  // the top may rise within the chunk: offer re-checks
    }
  }
  for (; i < V; ++i) offer(i);
  std::sort_heap(heap.begin(), heap.begin() + k, before);
  for (int64_t j = 0; j < k; ++j) {
    values[j] = static_cast<float>(heap[j].first);
    indices[j] = heap[j].second;
  }
}

std::tuple<at::Tensor, at::Tensor> topk_rows(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "topk_rows: x must be (R, V) float32");
  const int64_t R = x.size(0), V = x.size(1);
  TORCH_CHECK(k >= 1 && k * 64 <= V, "topk_rows: needs 1 <= k and k * 64 <= V (torch's partial_sort path)");
  const at::Tensor xc = x.contiguous();
  at::Tensor values = at::empty({R, k}, x.options());
  at::Tensor indices = at::empty({R, k}, x.options().dtype(at::kLong));
  const float* px = xc.data_ptr<float>();
  float* pv = values.data_ptr<float>();
  int64_t* pi = indices.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) topk_row(px + r * V, V, k, pv + r * k, pi + r * k);
  return {values, indices};
}

void move_kv(at::TensorList k_caches, at::TensorList v_caches, int64_t slot, int64_t start,
             at::IntArrayRef nodes) {
  for (size_t i = 0; i < nodes.size(); ++i)
    TORCH_CHECK(nodes[i] >= static_cast<int64_t>(i) && (i == 0 || nodes[i] > nodes[i - 1]),
                "move_kv: nodes must increase, nodes[i] >= i");
  for (const at::TensorList& caches : {k_caches, v_caches}) {
    for (const at::Tensor& c : caches) {  // (S, KV, P, D)
      TORCH_CHECK(c.dim() == 4 && c.is_contiguous() && c.device().is_cpu(), "move_kv: caches (S, KV, P, D), contiguous, CPU");
      TORCH_CHECK(slot >= 0 && slot < c.size(0) && start >= 0 && start + (nodes.empty() ? 0 : nodes.back()) < c.size(2),
                  "move_kv: slot or positions out of range");
      const int64_t KV = c.size(1), P = c.size(2), D = c.size(3), bytes = D * c.element_size();
      char* base = static_cast<char*>(c.data_ptr()) + slot * KV * P * bytes;
      for (int64_t h = 0; h < KV; ++h) {
        char* head = base + h * P * bytes;
        for (size_t i = 0; i < nodes.size(); ++i)
          if (nodes[i] != static_cast<int64_t>(i))
            std::memcpy(head + (start + static_cast<int64_t>(i)) * bytes, head + (start + nodes[i]) * bytes, bytes);
      }
    }
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specrouter_rowinv, m) {
  m.def("topk_rows(Tensor x, int k) -> (Tensor, Tensor)");
  m.def("move_kv(Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, int slot, int start, int[] nodes) -> ()");
}

TORCH_LIBRARY_IMPL(specrouter_rowinv, CPU, m) {
  m.impl("topk_rows", &topk_rows);
  m.impl("move_kv", &move_kv);
}
