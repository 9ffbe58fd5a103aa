// The few-row work of a generation step, one call each: a step of every chain's SSM recurrence, and a
// (normed) feed-forward block. A step runs one row per stream, and in PyTorch each of these is 10-25 ops whose
// launches cost more than their arithmetic (a few microseconds each on a CPU, batch 1).
//
// ssm_step(x (b, D), conv (b, K-1, C), ssm (b, H, P, N), in_proj (Z, D), conv_weight (C, K), conv_bias (C),
//          dt_bias (H), A_log (H), D (H), norm_weight (I), eps, out_proj (D, I), x_norm_weight, x_norm_bias (D) or
//          empty, x_eps) -> (y (b, D), conv', ssm')
//     SelectiveSSM.step of layer_norm(x) (of x where x_norm_weight is empty): Z = I + C + H, C = I + 2N,
//     I = H * P. The states are not modified: new ones are returned.
// feed_forward(x (n, C), ptr (S + 1), norm_weight, norm_bias (C) or empty, eps, fc_weight [S x (F_s, C)],
//              fc_bias [S x (F_s)], proj_weight [S x (C, F_s)], proj_bias [S x (C)]) -> (n, C)
//     proj_s(gelu(fc_s(layer_norm(x)))) on rows ptr[s] to ptr[s + 1] (S feed-forward blocks, e.g. one per node
//     type, in one call), the exact (erf) GELU; no norm where norm_weight is empty.
// block_tail(x (n, C), ptr, norm_weight, norm_bias, eps, fc_weight, fc_bias, proj_weight, proj_bias (as for
//            feed_forward), broadcast_weight (C, C), T) -> (n, C)
//     SheafBlock.step's tail: y = x + feed_forward(x, ...) (the experts' residual), then y[t] += broadcast_weight
//     y[n - T + t] for t < T (output t, among the last T rows, broadcast to token t, among the first T).
// stream_pools(query, keys, sources (M, P0), types, type_bias, sink, k, root, sink_threshold, block_query (M, r'),
//              block_key (J, S, r'), stream (M,), last (M,), token_rows (n, S), num_blocks, block_size, content_type,
//              first_dst) -> (source, dst, type, weight), (M k',) each, k' = min(k, P), P = num_blocks * B + P0
//     LearnedTopology's dense competition of every new output of a stream batch. Row m's pool: its content
//     proposals, the tokens (rows token_rows[jB + t, stream_m]) of the num_blocks best blocks j < last_m of its
//     stream by <block_query_m, block_key[j, stream_m]> (best first, equal scores: the lower block; -1 past the
//     blocks chosen), then its other candidates ``sources`` (-1: padding). Score s_p = <query_m, keys[pool_p]> /
//     root + type_bias[type_p] (-inf at padding); kept: the k' best in the order of a stable descending sort
//     (equal scores: the lower column), weighted by softmax([top_m, sink_m]) without the sink's, and with
//     sink_threshold weight 0 where the score is <= sink_m; returned as the edges into the outputs, row m's k'
//     edges into first_dst + m: their sources (padding: row 0, with weight 0), destinations, types and weights.
//
// stream_keys(h (N, D), state (R, D), previous_row (T,), no_previous (T,), num_rows, query_weight,
//             key_weight, key_previous_weight (r, D)) -> (query (N, r), key (num_rows, r))
//     LearnedTopology's projections of a stream batch's new nodes: query = h Wq^T for every node; key = h Wk^T
//     for the first num_rows (the non-outputs), plus, for the first T (the tokens), state[previous_row] Wp^T,
//     the cached state of the token before (nothing where no_previous: position 0).
//
// glue_diag(x (N, d * f), src (E,), ptr (N + 1,), edge_type (E,), edge_weight (E,), map_lin (2d, d * f),
//           map_type_emb (T, d), weight_channel (f, f), eps (d,), x_src (R, d * f) or empty, map_offset)
//           -> (N, d * f)
//     SheafConv with diag maps, no map hidden layer, no stalk mixing, normalize "none" and ELU, for edges sorted
//     by destination (CSR ptr): per destination v, lap_v = sum_e alpha_e F_v (F_v Y_v - F_u Y_u) with
//     F = map_offset + tanh(map_lin halves + type embedding) (map_offset 1: maps that start at the identity),
//     Y = X W1, and out_v = (1 + tanh eps) X_v - ELU(lap_v). Edge e's
//     source is row src[e] of x_src (bipartite: a stream's new nodes read their cached sources in place), or
//     of x where x_src is empty.
//
// Rows run in parallel (at::parallel_for, 8 rows a task: a batch-1 step stays on its thread). Products are
// dot products over contiguous weight rows, 2 x 64 bytes of lanes at a time, so sums are in another order
// than MKL's (float rounding).
// Pure-PyTorch references: SelectiveSSM.step_reference and feed_forward_reference.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <numeric>
#include <tuple>
#include <vector>

#include "top_list.h"

namespace {

constexpr int64_t kGrain = 8;  // rows per parallel task

template <typename T>
inline T dot(const T* a, const T* b, int64_t n) {
  typedef T V __attribute__((vector_size(64)));  // GCC/Clang vector extension: one AVX-512 register
  constexpr int64_t L = 64 / sizeof(T);
  V acc0{}, acc1{};
  int64_t i = 0;
  for (; i + 2 * L <= n; i += 2 * L) {
    V a0, a1, b0, b1;
    std::memcpy(&a0, a + i, sizeof(V));
    std::memcpy(&a1, a + i + L, sizeof(V));
    std::memcpy(&b0, b + i, sizeof(V));
    std::memcpy(&b1, b + i + L, sizeof(V));
    acc0 += a0 * b0;
    acc1 += a1 * b1;
  }
  if (i + L <= n) {
    V a0, b0;
    std::memcpy(&a0, a + i, sizeof(V));
    std::memcpy(&b0, b + i, sizeof(V));
    acc0 += a0 * b0;
    i += L;
  }
  acc0 += acc1;
  T s = 0;
  for (int64_t l = 0; l < L; ++l) s += acc0[l];
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// out[o] = <weight[o], x> (+ bias[o]) for o < rows: weight (rows, n) row-major.
template <typename T>
inline void linear(const T* x, const T* weight, const T* bias, T* out, int64_t rows, int64_t n) {
  for (int64_t o = 0; o < rows; ++o) out[o] = dot(weight + o * n, x, n) + (bias ? bias[o] : T(0));
}

template <typename T>
inline T silu(T v) { return v / (T(1) + std::exp(-v)); }

template <typename T>
inline T softplus(T v) { return v > T(20) ? v : std::log1p(std::exp(v)); }  // F.softplus, threshold 20

// out = F.layer_norm(row) (biased variance) with weight and bias, C channels
template <typename T>
inline void layer_norm_row(const T* row, const T* weight, const T* bias, double eps, int64_t C, T* out) {
  T mean = 0, var = 0;
  for (int64_t c = 0; c < C; ++c) mean += row[c];
  mean /= C;
  for (int64_t c = 0; c < C; ++c) var += (row[c] - mean) * (row[c] - mean);
  const T rstd = T(1) / std::sqrt(var / C + T(eps));
  for (int64_t c = 0; c < C; ++c) out[c] = (row[c] - mean) * rstd * weight[c] + bias[c];
}

// A kernel's floating tensors, checked to be on the CPU in `dtype` (that of its x) and made contiguous, in place.
void cpu_contiguous(std::initializer_list<torch::Tensor*> tensors, torch::ScalarType dtype, const char* name) {
  for (torch::Tensor* t : tensors) {
    TORCH_CHECK(t->device().is_cpu(), name, ": CPU tensors only");
    TORCH_CHECK(t->scalar_type() == dtype, name, ": every tensor needs the dtype of x (", dtype, "), got ",
                t->scalar_type());
    *t = t->contiguous();
  }
}

// A kernel's tensors, then a norm's weight and bias where it has one: checked to be on the CPU in the first one's
// dtype, and contiguous.
std::vector<torch::Tensor> checked_args(std::vector<torch::Tensor> args, bool normed, const torch::Tensor& weight,
                                        const torch::Tensor& bias, const char* name) {
  if (normed) {
    args.push_back(weight);
    args.push_back(bias);
  }
  const auto dtype = args[0].scalar_type();
  for (auto& t : args) cpu_contiguous({&t}, dtype, name);
  return args;
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> ssm_step(
    torch::Tensor x, torch::Tensor conv, torch::Tensor ssm, torch::Tensor in_proj, torch::Tensor conv_weight,
    torch::Tensor conv_bias, torch::Tensor dt_bias, torch::Tensor A_log, torch::Tensor D, torch::Tensor norm_weight,
    double eps, torch::Tensor out_proj, torch::Tensor x_norm_weight, torch::Tensor x_norm_bias, double x_eps) {
  TORCH_CHECK(x.dim() == 2 && conv.dim() == 3 && ssm.dim() == 4, "ssm_step: expected x (b, D), conv (b, K-1, C) "
              "and ssm (b, H, P, N), got ", x.sizes(), ", ", conv.sizes(), " and ", ssm.sizes());
  const int64_t b = x.size(0), Dm = x.size(1), H = ssm.size(1), P = ssm.size(2), N = ssm.size(3);
  const int64_t I = H * P, C = I + 2 * N, K = conv.size(1) + 1, Z = I + C + H;
  TORCH_CHECK(conv.size(0) == b && ssm.size(0) == b && conv.size(2) == C, "ssm_step: the states need one entry "
              "per row of x and conv (b, K-1, I + 2N), got ", conv.sizes(), " and ", ssm.sizes());
  TORCH_CHECK(in_proj.sizes() == torch::IntArrayRef({Z, Dm}) && conv_weight.sizes() == torch::IntArrayRef({C, K}) &&
              conv_bias.numel() == C && dt_bias.numel() == H && A_log.numel() == H && D.numel() == H &&
              norm_weight.numel() == I && out_proj.sizes() == torch::IntArrayRef({Dm, I}),
              "ssm_step: parameter shapes do not match the states");
  const bool x_normed = x_norm_weight.numel() > 0;
  TORCH_CHECK(!x_normed || (x_norm_weight.numel() == Dm && x_norm_bias.numel() == Dm),
              "ssm_step: the norm of x needs a weight and a bias of ", Dm);
  const auto args = checked_args({x, conv, ssm, in_proj, conv_weight, conv_bias, dt_bias, A_log, D, norm_weight,
                                   out_proj}, x_normed, x_norm_weight, x_norm_bias, "ssm_step");
  auto y = torch::empty({b, Dm}, x.options());
  auto conv_new = torch::empty_like(args[1]);
  auto ssm_new = torch::empty_like(args[2]);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "ssm_step", [&] {
    using T = scalar_t;
    const T *xp = args[0].data_ptr<T>(), *cp = args[1].data_ptr<T>(), *sp = args[2].data_ptr<T>();
    const T *w_in = args[3].data_ptr<T>(), *cw = args[4].data_ptr<T>(), *cb = args[5].data_ptr<T>();
    const T *dtb = args[6].data_ptr<T>(), *alog = args[7].data_ptr<T>(), *dskip = args[8].data_ptr<T>();
    const T *nw = args[9].data_ptr<T>(), *w_out = args[10].data_ptr<T>();
    const T* xw = x_normed ? args[11].data_ptr<T>() : nullptr;
    const T* xb = x_normed ? args[12].data_ptr<T>() : nullptr;
    T *yp = y.data_ptr<T>(), *cp_new = conv_new.data_ptr<T>(), *sp_new = ssm_new.data_ptr<T>();
    at::parallel_for(0, b, kGrain, [&](int64_t r0, int64_t r1) {
      std::vector<T> xn(Dm), zxbcdt(Z), xbc(C), g(I);
      for (int64_t r = r0; r < r1; ++r) {
        const T* row = xp + r * Dm;
        if (x_normed) {
          layer_norm_row(row, xw, xb, x_eps, Dm, xn.data());
          row = xn.data();
        }
        linear(row, w_in, static_cast<const T*>(nullptr), zxbcdt.data(), Z, Dm);
        const T* z = zxbcdt.data();
        const T* fresh = z + I;  // this step's conv input (C,)
        const T* dt_raw = fresh + C;
        const T* window = cp + r * (K - 1) * C;  // (K-1, C), oldest first
        for (int64_t c = 0; c < C; ++c) {  // the causal depthwise conv over [window, fresh], then SiLU
          T acc = 0;
          for (int64_t k = 0; k < K - 1; ++k) acc += window[k * C + c] * cw[c * K + k];
          xbc[c] = silu(acc + fresh[c] * cw[c * K + K - 1] + cb[c]);
        }
        T* shifted = cp_new + r * (K - 1) * C;  // the window moves on by one row
        if (K > 2) std::memcpy(shifted, window + C, (K - 2) * C * sizeof(T));
        if (K > 1) std::memcpy(shifted + (K - 2) * C, fresh, C * sizeof(T));
        const T *xs = xbc.data(), *Bv = xs + I, *Cv = Bv + N;
        for (int64_t h = 0; h < H; ++h) {
          const T dt = softplus(dt_raw[h] + dtb[h]);
          const T decay = std::exp(dt * -std::exp(alog[h]));
          for (int64_t p = 0; p < P; ++p) {
            const int64_t hp = h * P + p;
            const T u = dt * xs[hp];
            const T* old = sp + (r * I + hp) * N;
            T* state = sp_new + (r * I + hp) * N;
            T out = 0;
            for (int64_t n = 0; n < N; ++n) {
              state[n] = decay * old[n] + u * Bv[n];
              out += state[n] * Cv[n];
            }
            g[hp] = (out + xs[hp] * dskip[h]) * silu(z[hp]);  // y + D x, gated by SiLU(z)
          }
        }
        T mean_square = 0;
        for (int64_t i = 0; i < I; ++i) mean_square += g[i] * g[i];
        const T rstd = T(1) / std::sqrt(mean_square / I + T(eps));
        for (int64_t i = 0; i < I; ++i) g[i] *= rstd * nw[i];
        linear(g.data(), w_out, static_cast<const T*>(nullptr), yp + r * Dm, Dm, I);
      }
    });
  });
  return {y, conv_new, ssm_new};
}

// feed_forward and block_tail: out = [x +] FFN_s(x) per row segment s, then, with a broadcast weight, the first T
// rows += broadcast_weight @ the last T rows (output t -> token t).
torch::Tensor segment_feed_forward(torch::Tensor x, const std::vector<int64_t>& ptr, torch::Tensor norm_weight,
                                   torch::Tensor norm_bias, double eps, const std::vector<torch::Tensor>& fc_weight,
                                   const std::vector<torch::Tensor>& fc_bias,
                                   const std::vector<torch::Tensor>& proj_weight,
                                   const std::vector<torch::Tensor>& proj_bias, bool residual,
                                   torch::Tensor broadcast_weight, int64_t T, const char* name) {
  TORCH_CHECK(x.dim() == 2, name, ": expected x (n, C), got ", x.sizes());
  const int64_t n = x.size(0), C = x.size(1), S = static_cast<int64_t>(ptr.size()) - 1;
  TORCH_CHECK(S >= 1 && ptr[0] == 0 && ptr[S] == n && std::is_sorted(ptr.begin(), ptr.end()),
              name, ": ptr must rise from 0 to x.size(0) = ", n, ", got ", torch::IntArrayRef(ptr));
  TORCH_CHECK(static_cast<int64_t>(fc_weight.size()) == S && static_cast<int64_t>(fc_bias.size()) == S &&
              static_cast<int64_t>(proj_weight.size()) == S && static_cast<int64_t>(proj_bias.size()) == S,
              name, ": need one set of weights per segment (", S, ")");
  const bool normed = norm_weight.numel() > 0, broadcast = broadcast_weight.defined() && broadcast_weight.numel() > 0;
  TORCH_CHECK(!normed || (norm_weight.numel() == C && norm_bias.numel() == C),
              name, ": the norm's shapes do not match x (n, ", C, ")");
  TORCH_CHECK(!broadcast || (broadcast_weight.sizes() == torch::IntArrayRef({C, C}) && T >= 0 && 2 * T <= n),
              name, ": expected broadcast_weight (C, C) and 2 T <= n rows, got ", broadcast_weight.sizes(), " and T = ",
              T);
  std::vector<std::vector<torch::Tensor>> weights;  // per segment: fc weight, bias, proj weight, bias (+ norm)
  for (int64_t s = 0; s < S; ++s) {
    const int64_t F = fc_weight[s].size(0);
    TORCH_CHECK(fc_weight[s].sizes() == torch::IntArrayRef({F, C}) && fc_bias[s].numel() == F &&
                proj_weight[s].sizes() == torch::IntArrayRef({C, F}) && proj_bias[s].numel() == C,
                name, ": segment ", s, "'s parameter shapes do not match x (n, ", C, ")");
    weights.push_back(checked_args({x, fc_weight[s], fc_bias[s], proj_weight[s], proj_bias[s]}, normed,
                                   norm_weight, norm_bias, name));
  }
  if (broadcast) cpu_contiguous({&broadcast_weight}, x.scalar_type(), name);
  auto out = torch::empty({n, C}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "segment_feed_forward", [&] {
    using T_ = scalar_t;
    const T_* xp = weights[0][0].data_ptr<T_>();
    const T_* nw = normed ? weights[0][5].data_ptr<T_>() : nullptr;
    const T_* nb = normed ? weights[0][6].data_ptr<T_>() : nullptr;
    T_* op = out.data_ptr<T_>();
    at::parallel_for(0, n, kGrain, [&](int64_t r0, int64_t r1) {
      std::vector<T_> xn(C), u;
      int64_t s = std::upper_bound(ptr.begin(), ptr.end(), r0) - ptr.begin() - 1;  // the segment of row r0
      for (int64_t r = r0; r < r1; ++r) {
        while (r >= ptr[s + 1]) ++s;
        const auto& w = weights[s];
        const int64_t F = w[1].size(0);
        u.resize(F);
        const T_* row = xp + r * C;
        if (normed) {
          layer_norm_row(row, nw, nb, eps, C, xn.data());
          row = xn.data();
        }
        linear(row, w[1].data_ptr<T_>(), w[2].data_ptr<T_>(), u.data(), F, C);
        for (int64_t f = 0; f < F; ++f) u[f] = T_(0.5) * u[f] * (T_(1) + std::erf(u[f] * T_(M_SQRT1_2)));
        linear(u.data(), w[3].data_ptr<T_>(), w[4].data_ptr<T_>(), op + r * C, C, F);
        if (residual)
          for (int64_t c = 0; c < C; ++c) op[r * C + c] += xp[r * C + c];
      }
    });
    if (broadcast) {  // after every row: the token rows read the finished output rows
      const T_* bw = broadcast_weight.data_ptr<T_>();
      std::vector<T_> b(C);
      for (int64_t t = 0; t < T; ++t) {
        linear(op + (n - T + t) * C, bw, static_cast<const T_*>(nullptr), b.data(), C, C);
        for (int64_t c = 0; c < C; ++c) op[t * C + c] += b[c];
      }
    }
  });
  return out;
}

torch::Tensor feed_forward(torch::Tensor x, std::vector<int64_t> ptr, torch::Tensor norm_weight,
                           torch::Tensor norm_bias, double eps, std::vector<torch::Tensor> fc_weight,
                           std::vector<torch::Tensor> fc_bias, std::vector<torch::Tensor> proj_weight,
                           std::vector<torch::Tensor> proj_bias) {
  return segment_feed_forward(x, ptr, norm_weight, norm_bias, eps, fc_weight, fc_bias, proj_weight, proj_bias, false,
                              torch::Tensor(), 0, "feed_forward");
}

torch::Tensor block_tail(torch::Tensor x, std::vector<int64_t> ptr, torch::Tensor norm_weight, torch::Tensor norm_bias,
                         double eps, std::vector<torch::Tensor> fc_weight, std::vector<torch::Tensor> fc_bias,
                         std::vector<torch::Tensor> proj_weight, std::vector<torch::Tensor> proj_bias,
                         torch::Tensor broadcast_weight, int64_t num_tokens) {
  TORCH_CHECK(broadcast_weight.defined() && broadcast_weight.numel() > 0, "block_tail: needs a broadcast weight");
  return segment_feed_forward(x, ptr, norm_weight, norm_bias, eps, fc_weight, fc_bias, proj_weight, proj_bias, true,
                              broadcast_weight, num_tokens, "block_tail");
}

// One destination's dense competition (stream_pools): its pool's scores, then the k best in the order
// of torch.sort(descending=True, stable=True) and their softmax weights with the sink.
template <typename T>
struct Competition {
  std::vector<T> s;
  std::vector<int64_t> order;
  explicit Competition(int64_t P) : s(P), order(P) {}

  // s_p = <query, keys[sources_p]> / root + bias[types_p], -inf where sources_p < 0
  void score(const T* query, const T* keys, int64_t r, const int64_t* sources, const int64_t* types, const T* bias,
             double root) {
    for (size_t p = 0; p < s.size(); ++p) {
      s[p] = sources[p] < 0 ? -std::numeric_limits<T>::infinity()
                            : dot(query, keys + sources[p] * r, r) / T(root) + bias[types[p]];
    }
  }

  // order[:k] := the k best columns (NaN first, then by value, equal values by column); top, weight (k,)
  void compete(int64_t k, T sink, T* top, T* weight) {
    auto before = [&](int64_t a, int64_t b) {
      const bool na = std::isnan(s[a]), nb = std::isnan(s[b]);
      if (na != nb) return na;
      if (!na && s[a] != s[b]) return s[a] > s[b];
      return a < b;
    };
    std::iota(order.begin(), order.end(), int64_t(0));
    std::partial_sort(order.begin(), order.begin() + k, order.end(), before);
    T hi = sink;
    for (int64_t i = 0; i < k; ++i) hi = std::max(hi, s[order[i]]);
    T total = std::exp(sink - hi);
    for (int64_t i = 0; i < k; ++i) {
      top[i] = s[order[i]];
      weight[i] = std::exp(top[i] - hi);  // exp(-inf) = 0: padding weighs nothing
      total += weight[i];
    }
    for (int64_t i = 0; i < k; ++i) weight[i] /= total;
  }
};

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> stream_pools(
    torch::Tensor query, torch::Tensor keys, torch::Tensor sources, torch::Tensor types, torch::Tensor type_bias,
    torch::Tensor sink, int64_t k, double root, bool sink_threshold, torch::Tensor block_query,
    torch::Tensor block_key, torch::Tensor stream, torch::Tensor last, torch::Tensor token_rows, int64_t num_blocks,
    int64_t block_size, int64_t content_type, int64_t first_dst) {
  TORCH_CHECK(query.dim() == 2 && keys.dim() == 2 && query.size(1) == keys.size(1) && sources.dim() == 2 &&
              sources.size(0) == query.size(0) && types.sizes() == sources.sizes() && sink.numel() == query.size(0),
              "stream_pools: expected query (M, r), keys (R, r), sources and types (M, P0), sink (M,), got ",
              query.sizes(), ", ", keys.sizes(), ", ", sources.sizes(), ", ", types.sizes(), ", ", sink.sizes());
  const int64_t M = query.size(0), r = query.size(1), R = keys.size(0), P0 = sources.size(1);
  const int64_t T = type_bias.numel(), B = block_size, m = num_blocks, P = m * B + P0;
  TORCH_CHECK(k >= 1 && root > 0 && m >= 0 && B >= 1 && content_type >= 0 && content_type < T,
              "stream_pools: need k >= 1, root > 0, num_blocks >= 0, block_size >= 1 and a content type < ", T);
  TORCH_CHECK(m == 0 || (block_query.dim() == 2 && block_query.size(0) == M && block_key.dim() == 3 &&
                         block_key.size(2) == block_query.size(1) && stream.numel() == M && last.numel() == M &&
                         token_rows.dim() == 2 && token_rows.size(1) == block_key.size(1) &&
                         token_rows.size(0) >= block_key.size(0) * B),
              "stream_pools: expected block_query (M, r'), block_key (J, S, r'), stream and last (M,), token_rows "
              "(>= J * block_size, S), got ", block_query.sizes(), ", ", block_key.sizes(), ", ", token_rows.sizes());
  const auto dtype = query.scalar_type();
  cpu_contiguous({&query, &keys, &type_bias, &sink}, dtype, "stream_pools");
  if (m > 0) cpu_contiguous({&block_query, &block_key}, dtype, "stream_pools");
  sources = sources.to(torch::kLong).contiguous();
  types = types.to(torch::kLong).contiguous();
  const int64_t J = m > 0 ? block_key.size(0) : 0, S = m > 0 ? block_key.size(1) : 1;
  if (m > 0) {
    stream = stream.to(torch::kLong).contiguous();
    last = last.to(torch::kLong).contiguous();
    // read in place through its strides: a stream's table of rows is a strided view that grows with the context
    TORCH_CHECK(token_rows.scalar_type() == torch::kLong, "stream_pools: token_rows must be int64");
  }
  // The pools, checked here (a kernel thread cannot throw): sources and token rows within the keys, types
  // within the biases, streams within the block keys.
  const int64_t *src = sources.data_ptr<int64_t>(), *typ = types.data_ptr<int64_t>();
  for (int64_t i = 0; i < M * P0; ++i) {
    TORCH_CHECK(src[i] < R && (src[i] < 0 || (typ[i] >= 0 && typ[i] < T)),
                "stream_pools: a source past the ", R, " key rows or an edge type past the ", T, " biases");
  }
  const int64_t* st = m > 0 ? stream.data_ptr<int64_t>() : nullptr;
  const int64_t* la = m > 0 ? last.data_ptr<int64_t>() : nullptr;
  const int64_t* rows = m > 0 ? token_rows.data_ptr<int64_t>() : nullptr;
  const int64_t row_stride = m > 0 ? token_rows.stride(0) : 0, stream_stride = m > 0 ? token_rows.stride(1) : 0;
  for (int64_t i = 0; m > 0 && i < M; ++i) TORCH_CHECK(st[i] >= 0 && st[i] < S, "stream_pools: a stream past ", S);
  std::atomic<bool> bad_row{false};  // a token row of a chosen block past the keys (only those are read)
  const int64_t kk = std::min(k, P);
  auto source = torch::empty({M * kk}, sources.options());
  auto dst = torch::empty({M * kk}, sources.options());
  auto type = torch::empty({M * kk}, sources.options());
  auto weight = torch::empty({M * kk}, query.options());
  AT_DISPATCH_FLOATING_TYPES(query.scalar_type(), "stream_pools", [&] {
    using T_ = scalar_t;
    const T_ *q = query.data_ptr<T_>(), *kp = keys.data_ptr<T_>(), *bias = type_bias.data_ptr<T_>();
    const T_ *sk = sink.data_ptr<T_>(), *bq = m > 0 ? block_query.data_ptr<T_>() : nullptr;
    const T_* bk = m > 0 ? block_key.data_ptr<T_>() : nullptr;
    const int64_t rb = m > 0 ? block_query.size(1) : 0;
    at::parallel_for(0, M, kGrain, [&](int64_t m0, int64_t m1) {
      Competition<T_> row(P);
      std::vector<int64_t> pool(P), pool_type(P), best(m);
      std::vector<T_> best_score(m), top(kk);
      for (int64_t i = m0; i < m1; ++i) {
        int64_t chosen = 0;  // the num_blocks best blocks, as block_topk ranks them
        for (int64_t j = 0; j < std::min(m > 0 ? la[i] : 0, J); ++j) {
          const T_ v = dot(bq + i * rb, bk + (j * S + st[i]) * rb, rb);
          if (std::isfinite(v) && (chosen < m || v > best_score[m - 1])) {
            sheafgnn::insert(v, j, best_score.data(), best.data(), chosen, m);
          }
        }
        for (int64_t b = 0; b < m; ++b) {
          for (int64_t t = 0; t < B; ++t) {
            pool[b * B + t] = b < chosen ? rows[(best[b] * B + t) * row_stride + st[i] * stream_stride] : -1;
            if (pool[b * B + t] >= R) bad_row = true, pool[b * B + t] = -1;
            pool_type[b * B + t] = content_type;
          }
        }
        std::copy(src + i * P0, src + (i + 1) * P0, pool.begin() + m * B);
        std::copy(typ + i * P0, typ + (i + 1) * P0, pool_type.begin() + m * B);
        row.score(q + i * r, kp, r, pool.data(), pool_type.data(), bias, root);
        T_* w = weight.data_ptr<T_>() + i * kk;
        row.compete(kk, sk[i], top.data(), w);
        for (int64_t c = 0; c < kk; ++c) {
          if (sink_threshold && top[c] <= sk[i]) w[c] = T_(0);  // the sink outscores it: not kept
          source.data_ptr<int64_t>()[i * kk + c] = std::max<int64_t>(pool[row.order[c]], 0);
          dst.data_ptr<int64_t>()[i * kk + c] = first_dst + i;
          type.data_ptr<int64_t>()[i * kk + c] = pool_type[row.order[c]];
        }
      }
    });
  });
  TORCH_CHECK(!bad_row, "stream_pools: a token row past the ", R, " key rows");
  return {source, dst, type, weight};
}

torch::Tensor glue_diag(torch::Tensor x, torch::Tensor src, torch::Tensor ptr, torch::Tensor edge_type,
                        torch::Tensor edge_weight, torch::Tensor map_lin, torch::Tensor map_type_emb,
                        torch::Tensor weight_channel, torch::Tensor eps, torch::Tensor x_src, double map_offset) {
  const int64_t d = eps.numel(), f = weight_channel.size(0);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == d * f && weight_channel.sizes() == torch::IntArrayRef({f, f}) &&
              map_lin.sizes() == torch::IntArrayRef({2 * d, d * f}) && map_type_emb.dim() == 2 &&
              map_type_emb.size(1) == d, "glue_diag: expected x (N, d * f), map_lin (2d, d * f), map_type_emb "
              "(T, d), weight_channel (f, f), eps (d,), got ", x.sizes(), ", ", map_lin.sizes(), ", ",
              map_type_emb.sizes(), ", ", weight_channel.sizes(), ", ", eps.sizes());
  const int64_t N = x.size(0), E = src.numel(), T = map_type_emb.size(0), D = d * f;
  if (x_src.numel() == 0) x_src = x;  // the sources are rows of x
  TORCH_CHECK(ptr.numel() == N + 1 && edge_type.numel() == E && edge_weight.numel() == E &&
              x_src.dim() == 2 && x_src.size(1) == D, "glue_diag: expected ptr (N + 1,), one type and weight "
              "per edge, and x_src (R, d * f) or empty, got ", ptr.sizes(), " and ", x_src.sizes());
  const int64_t R = x_src.size(0);
  cpu_contiguous({&x, &edge_weight, &map_lin, &map_type_emb, &weight_channel, &eps, &x_src}, x.scalar_type(),
                 "glue_diag");
  src = src.to(torch::kLong).contiguous();
  ptr = ptr.to(torch::kLong).contiguous();
  edge_type = edge_type.to(torch::kLong).contiguous();
  const int64_t *sp = src.data_ptr<int64_t>(), *pp = ptr.data_ptr<int64_t>(), *tp = edge_type.data_ptr<int64_t>();
  TORCH_CHECK(pp[0] == 0 && pp[N] == E, "glue_diag: ptr must run from 0 to the number of edges");
  for (int64_t v = 0; v < N; ++v) TORCH_CHECK(pp[v] <= pp[v + 1], "glue_diag: ptr must not decrease");
  for (int64_t e = 0; e < E; ++e) {
    TORCH_CHECK(sp[e] >= 0 && sp[e] < R && tp[e] >= 0 && tp[e] < T, "glue_diag: a source past the ", R,
                " rows or an edge type past the ", T, " embeddings");
  }
  auto out = torch::empty({N, D}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "glue_diag", [&] {
    using T_ = scalar_t;
    const T_ offset = static_cast<T_>(map_offset);
    const T_ *xp = x.data_ptr<T_>(), *xs = x_src.data_ptr<T_>(), *wp = edge_weight.data_ptr<T_>();
    const T_* ml = map_lin.data_ptr<T_>();
    const T_ *emb = map_type_emb.data_ptr<T_>(), *w1 = weight_channel.data_ptr<T_>(), *ep = eps.data_ptr<T_>();
    T_* op = out.data_ptr<T_>();
    at::parallel_for(0, N, kGrain, [&](int64_t v0, int64_t v1) {
      // per row: g = map_lin x (2d), Y = X W1 (d, f), W1 read transposed so that each entry is a dot product
      std::vector<T_> w1t(f * f), g_v(2 * d), g_u(2 * d), y_v(D), y_u(D), lap(D);
      for (int64_t a = 0; a < f; ++a)
        for (int64_t b = 0; b < f; ++b) w1t[b * f + a] = w1[a * f + b];
      auto transform = [&](const T_* row, T_* g, T_* y) {
        linear(row, ml, static_cast<const T_*>(nullptr), g, 2 * d, D);
        for (int64_t i = 0; i < d; ++i)
          for (int64_t j = 0; j < f; ++j) y[i * f + j] = dot(row + i * f, w1t.data() + j * f, f);
      };
      for (int64_t v = v0; v < v1; ++v) {
        const T_* xv = xp + v * D;
        std::fill(lap.begin(), lap.end(), T_(0));
        if (pp[v + 1] > pp[v]) transform(xv, g_v.data(), y_v.data());
        for (int64_t e = pp[v]; e < pp[v + 1]; ++e) {
          transform(xs + sp[e] * D, g_u.data(), y_u.data());
          const T_* te = emb + tp[e] * d;
          for (int64_t i = 0; i < d; ++i) {
            const T_ f_u = offset + std::tanh(g_u[i] + g_v[d + i] + te[i]);  // Psi(x_u, x_v)
            const T_ f_v = offset + std::tanh(g_v[i] + g_u[d + i] + te[i]);  // Psi(x_v, x_u)
            const T_ a = wp[e] * f_v;
            for (int64_t j = 0; j < f; ++j) lap[i * f + j] += a * (f_v * y_v[i * f + j] - f_u * y_u[i * f + j]);
          }
        }
        for (int64_t i = 0; i < d; ++i) {
          const T_ scale = T_(1) + std::tanh(ep[i]);
          for (int64_t j = 0; j < f; ++j) {
            const T_ l = lap[i * f + j];
            op[v * D + i * f + j] = scale * xv[i * f + j] - (l > 0 ? l : std::expm1(l));  // ELU
          }
        }
      }
    });
  });
  return out;
}

// stream_keys: the new nodes' topology queries and keys (see the top of the file).
std::tuple<torch::Tensor, torch::Tensor> stream_keys(torch::Tensor h, torch::Tensor state, torch::Tensor previous_row,
                                                     torch::Tensor no_previous, int64_t num_rows,
                                                     torch::Tensor query_weight, torch::Tensor key_weight,
                                                     torch::Tensor key_previous_weight) {
  TORCH_CHECK(h.dim() == 2 && state.dim() == 2 && state.size(1) == h.size(1) && previous_row.dim() == 1 &&
              no_previous.numel() == previous_row.numel() && previous_row.numel() <= num_rows &&
              num_rows <= h.size(0), "stream_keys: expected h (N, D), state (R, D), previous_row and no_previous "
              "(T,), T <= num_rows <= N, got ", h.sizes(), ", ", state.sizes(), ", ", previous_row.sizes(), ", ",
              no_previous.sizes(), ", ", num_rows);
  const int64_t N = h.size(0), D = h.size(1), r = query_weight.size(0), T = previous_row.numel();
  const int64_t R = state.size(0);
  TORCH_CHECK(query_weight.sizes() == torch::IntArrayRef({r, D}) && key_weight.sizes() == query_weight.sizes() &&
              key_previous_weight.sizes() == query_weight.sizes(),
              "stream_keys: expected three (r, D) weights, got ", query_weight.sizes(), ", ", key_weight.sizes(),
              ", ", key_previous_weight.sizes());
  cpu_contiguous({&h, &state, &query_weight, &key_weight, &key_previous_weight}, h.scalar_type(), "stream_keys");
  previous_row = previous_row.to(torch::kLong).contiguous();
  no_previous = no_previous.to(torch::kBool).contiguous();
  const int64_t* prev = previous_row.data_ptr<int64_t>();
  const bool* none = no_previous.data_ptr<bool>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(none[t] || (prev[t] >= 0 && prev[t] < R), "stream_keys: a previous row past the ", R, " cached rows");
  }
  auto query = torch::empty({N, r}, h.options());
  auto key = torch::empty({num_rows, r}, h.options());
  AT_DISPATCH_FLOATING_TYPES(h.scalar_type(), "stream_keys", [&] {
    using T_ = scalar_t;
    const T_ *hp = h.data_ptr<T_>(), *sp = state.data_ptr<T_>(), *wq = query_weight.data_ptr<T_>();
    const T_ *wk = key_weight.data_ptr<T_>(), *wp = key_previous_weight.data_ptr<T_>();
    T_ *qp = query.data_ptr<T_>(), *kp = key.data_ptr<T_>();
    at::parallel_for(0, N, kGrain, [&](int64_t n0, int64_t n1) {
      std::vector<T_> from_previous(r);
      for (int64_t n = n0; n < n1; ++n) {
        linear(hp + n * D, wq, static_cast<const T_*>(nullptr), qp + n * r, r, D);
        if (n >= num_rows) continue;  // outputs: never sources, no key
        linear(hp + n * D, wk, static_cast<const T_*>(nullptr), kp + n * r, r, D);
        if (n < T && !none[n]) {  // a token's key also reads the token before it
          linear(sp + prev[n] * D, wp, static_cast<const T_*>(nullptr), from_previous.data(), r, D);
          for (int64_t i = 0; i < r; ++i) kp[n * r + i] += from_previous[i];
        }
      }
    });
  });
  return {query, key};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("ssm_step", &ssm_step, "One step of every chain's selective SSM recurrence (see step_kernels.cpp)");
  m.def("feed_forward", &feed_forward, "proj(gelu(fc(layer_norm(x)))) on a few rows (see step_kernels.cpp)");
  m.def("block_tail", &block_tail, "x + the experts of x, then the broadcast (see step_kernels.cpp)");
  m.def("glue_diag", &glue_diag, "SheafConv with diag maps for inference (see step_kernels.cpp)");
  m.def("stream_pools", &stream_pools, "The competition of a stream batch's new outputs (see step_kernels.cpp)");
  m.def("stream_keys", &stream_keys, "The topology queries and keys of new nodes (see step_kernels.cpp)");
}
