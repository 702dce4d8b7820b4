// Counter-based sampling noise, native: `coupled_argmax` of decoding/noise.py in one call.
//
// Same function as the torch path (noise.py's docstring has the derivation): per row n with
// position key key[n], token v of vocabulary block b (BLOCK tokens, the vocabulary padded with
// -inf) gets E_v = M_b + (v is the block's argmin ? 0 : -log U(key, "token", v)), with
// M_b = -log U(key, "block_min", b) / BLOCK, and the row samples argmax_v scores[v] - log E_v.
// Blocks are visited in decreasing order of their bound max(scores in b) - log M_b until the
// best score found beats the next bound, so a peaked distribution costs one or two blocks. The
// hash is the same 32-bit mixing on the same counters; logs are float64 (std::log here, torch's
// vectorized log there: they agree to the last bit or one ulp, so the two paths choose the same
// token unless two noisy scores tie to within ~1e-16).
//
// One Python call per step instead of ~100 small torch ops (the torch path's cost on CPU).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

namespace {

constexpr int64_t BLOCK = 64;  // noise.py BLOCK
constexpr uint32_t M1 = 0x7FEB352Du, M2 = 0x846CA68Bu, GOLDEN = 0x9E3779B1u;
constexpr uint32_t STREAM_TOKEN = 0x3C6EF372u, STREAM_MIN = 0x5851F42Du, STREAM_ARG = 0x14057B7Eu;

inline uint32_t mix32(uint32_t x) {  // lowbias32
  x ^= x >> 16;
  x *= M1;
  x ^= x >> 15;
  x *= M2;
  return x ^ (x >> 16);
}

inline double uniform(uint32_t key, uint32_t stream, uint64_t counter) {
  uint32_t x = mix32(key ^ stream);
  x = mix32(x + static_cast<uint32_t>(counter * GOLDEN));
  x = mix32(x ^ key);
  return (static_cast<double>(x) + 0.5) * (1.0 / 4294967296.0);
}

template <typename T>
int64_t row_argmax(const T* s, int64_t V, uint32_t key, std::vector<double>& bound,
                   std::vector<double>& minima, std::vector<int64_t>& order) {
  const int64_t nb = (V + BLOCK - 1) / BLOCK;
  constexpr double NEG_INF = -std::numeric_limits<double>::infinity();
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t lo = b * BLOCK, hi = std::min(V, lo + BLOCK);
    double mx = NEG_INF;
    bool nan = false;
    for (int64_t v = lo; v < hi; ++v) {
      const double x = static_cast<double>(s[v]);
      nan |= std::isnan(x);
      mx = x > mx ? x : mx;
    }
    TORCH_CHECK(!nan, "invalid distribution: NaN scores (non-finite logits or temperature)");
    minima[b] = -std::log(uniform(key, STREAM_MIN, b)) / BLOCK;
    bound[b] = mx - std::log(minima[b]);
  }
  std::iota(order.begin(), order.begin() + nb, int64_t{0});
  // the most promising blocks first; a partial sort of the head usually suffices
  const int64_t head = std::min<int64_t>(nb, 16);
  auto by_bound = [&](int64_t a, int64_t b) { return bound[a] > bound[b] || (bound[a] == bound[b] && a < b); };
  std::partial_sort(order.begin(), order.begin() + head, order.begin() + nb, by_bound);
  double best = NEG_INF;
  int64_t token = -1;
  for (int64_t i = 0; i < nb; ++i) {
    if (i == head) std::sort(order.begin() + head, order.begin() + nb, by_bound);
    const int64_t b = order[i];
    if (token >= 0 && best > bound[b]) break;  // no token of this or a later block can win
    const int64_t lo = b * BLOCK, hi = std::min(V, lo + BLOCK);
    int64_t arg = static_cast<int64_t>(uniform(key, STREAM_ARG, b) * BLOCK);
    arg = std::min(arg, BLOCK - 1);
    for (int64_t v = lo; v < hi; ++v) {
      const double x = static_cast<double>(s[v]);
      if (x == NEG_INF) continue;  // filtered: never sampled
      const double extra = (v - lo == arg) ? 0.0 : -std::log(uniform(key, STREAM_TOKEN, v));
      const double score = x - std::log(minima[b] + extra);
      if (score > best || token < 0) {
        best = score;
        token = v;
      }
    }
  }
  return token < 0 ? 0 : token;  // every score -inf: index 0, as argmax over the whole row
}

// scores (N, V) float32 or float64 (scaled logits, -inf = filtered), keys (N,) int64 position
// keys (32-bit values) -> (N,) int64 tokens
at::Tensor coupled_argmax(const at::Tensor& scores, const at::Tensor& keys) {
  TORCH_CHECK(scores.dim() == 2 && scores.device().is_cpu(), "scores: (N, V) on the CPU");
  TORCH_CHECK(keys.dim() == 1 && keys.size(0) == scores.size(0) && keys.scalar_type() == at::kLong,
              "keys: (N,) int64");
  const auto dt = scores.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kDouble, "coupled_argmax: float32 or float64 scores, got ", dt);
  at::Tensor s = scores.contiguous();
  at::Tensor k = keys.contiguous();
  const int64_t N = s.size(0), V = s.size(1);
  at::Tensor out = at::empty({N}, keys.options());
  if (N == 0) return out;
  TORCH_CHECK(V > 0, "scores: empty vocabulary");
  const int64_t nb = (V + BLOCK - 1) / BLOCK;
  const int64_t* kp = k.data_ptr<int64_t>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> bound(nb), minima(nb);
    std::vector<int64_t> order(nb);
    for (int64_t n = begin; n < end; ++n) {
      const uint32_t key = static_cast<uint32_t>(kp[n]);
      op[n] = dt == at::kFloat
                  ? row_argmax(s.data_ptr<float>() + n * V, V, key, bound, minima, order)
                  : row_argmax(s.data_ptr<double>() + n * V, V, key, bound, minima, order);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specrouter_rowinv, m) {
  m.def("coupled_argmax(Tensor scores, Tensor keys) -> Tensor");
}

TORCH_LIBRARY_IMPL(specrouter_rowinv, CPU, m) {
  m.impl("coupled_argmax", &coupled_argmax);
}
