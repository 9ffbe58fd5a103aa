// The best blocks of every query row, scored and ranked in one pass: no (rows x blocks) score matrix.
//
// block_topk(query (M, r), keys (J, r), first (M,), last (M,), k) -> (M, k) int64
//
// Row m gets the k blocks j in [first[m], last[m]) with the largest finite <query[m], keys[j]>, best first,
// -1 where fewer qualify; equal scores rank by block index (the lower first). The keys are laid out in tiles of
// 64 blocks, channel-major, so that a row's scores accumulate over the r channels in order, 16 or more blocks
// per vector instruction. Rows run in parallel (at::parallel_for); four rows share each tile's keys,
// and a tile whose best score is below a row's k-th best so far is not scanned.
// Pure-PyTorch reference: sheafgnn.nn.proposals.ranked_blocks_reference (chunked matmul + topk).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "top_list.h"

namespace {

constexpr int64_t kTile = 32;  // blocks scored at once: kRows x kTile float accumulators fit the vector registers
constexpr int64_t kRows = 4;   // rows sharing each load of a tile's keys

// Scores of `rows` (<= kRows) query rows (r channels each) against one tile of kTile blocks, whose keys are
// laid out channel-major (`tile`: r x kTile, zero past the last block): s[i][jj] = sum_c q_i[c] * tile[c][jj],
// accumulated over c in order. The hot path (kRows rows) also gives each row's best score in the tile and
// returns true.
template <typename scalar_t>
inline bool score_tile(const scalar_t* query, const scalar_t* tile, int64_t r, int64_t rows,
                       scalar_t (&s)[kRows][kTile], scalar_t (&tile_max)[kRows]) {
  if (rows == kRows) {  // the hot path: kRows x kTile accumulators held in vector registers across the channels
    typedef scalar_t V __attribute__((vector_size(64)));  // one AVX-512 register (GCC/Clang vector extension)
    constexpr int64_t L = 64 / sizeof(scalar_t), W = kTile / L;  // lanes, vectors per row
    V acc[kRows][W] = {};
    if constexpr (W == 2 && kRows == 4) {  // float: eight named accumulators, so that none is spilled
      V a00{}, a01{}, a10{}, a11{}, a20{}, a21{}, a30{}, a31{};
      for (int64_t c = 0; c < r; ++c) {
        V k0, k1;
        std::memcpy(&k0, tile + c * kTile, sizeof(V));
        std::memcpy(&k1, tile + c * kTile + L, sizeof(V));
        const scalar_t q0 = query[c], q1 = query[r + c], q2 = query[2 * r + c], q3 = query[3 * r + c];
        a00 += q0 * k0; a01 += q0 * k1;
        a10 += q1 * k0; a11 += q1 * k1;
        a20 += q2 * k0; a21 += q2 * k1;
        a30 += q3 * k0; a31 += q3 * k1;
      }
      acc[0][0] = a00; acc[0][1] = a01; acc[1][0] = a10; acc[1][1] = a11;
      acc[2][0] = a20; acc[2][1] = a21; acc[3][0] = a30; acc[3][1] = a31;
    } else {
      for (int64_t c = 0; c < r; ++c) {
        V key[W];
        std::memcpy(key, tile + c * kTile, sizeof(key));
        for (int64_t i = 0; i < kRows; ++i) {
          const scalar_t qc = query[i * r + c];
          for (int64_t w = 0; w < W; ++w) acc[i][w] += qc * key[w];
        }
      }
    }
    std::memcpy(s, acc, sizeof(acc));
    for (int64_t i = 0; i < kRows; ++i) {  // each row's best score in the tile; NaN never wins
      V best = V{} - std::numeric_limits<scalar_t>::infinity();  // -inf in every lane
      for (int64_t w = 0; w < W; ++w) best = acc[i][w] > best ? acc[i][w] : best;
      scalar_t m = best[0];
      for (int64_t l = 1; l < L; ++l) m = best[l] > m ? best[l] : m;
      tile_max[i] = m;
    }
    return true;
  }
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t jj = 0; jj < kTile; ++jj) s[i][jj] = 0;
    for (int64_t c = 0; c < r; ++c) {
      const scalar_t qc = query[i * r + c];
      const scalar_t* kc = tile + c * kTile;
      for (int64_t jj = 0; jj < kTile; ++jj) s[i][jj] += qc * kc[jj];
    }
  }
  return false;
}

template <typename scalar_t>
void block_topk_rows(const scalar_t* query, const scalar_t* tiles, const int64_t* first, const int64_t* last,
                     int64_t* out, int64_t r, int64_t J, int64_t k, int64_t row0, int64_t row1) {
  alignas(64) scalar_t s[kRows][kTile];
  scalar_t tile_max[kRows];
  std::vector<scalar_t> top(kRows * k);
  int64_t size[kRows];
  for (int64_t a = row0; a < row1; a += kRows) {
    const int64_t rows = std::min(kRows, row1 - a);
    int64_t lo = J, hi = 0;  // the union of the rows' ranges
    for (int64_t i = 0; i < rows; ++i) {
      lo = std::min(lo, std::max<int64_t>(first[a + i], 0));
      hi = std::max(hi, std::min<int64_t>(last[a + i], J));
      size[i] = 0;
    }
    for (int64_t j0 = lo - lo % kTile; j0 < hi; j0 += kTile) {
      const bool maxima = score_tile<scalar_t>(query + a * r, tiles + j0 * r, r, rows, s, tile_max);
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t from = std::max<int64_t>(first[a + i], j0) - j0;
        const int64_t to = std::min<int64_t>(std::min<int64_t>(last[a + i], J), j0 + kTile) - j0;
        scalar_t* t = top.data() + i * k;
        // Most tiles hold nothing better than the row's k-th best so far: their maximum skips them (a tile
        // inside the row's range has it from the registers; an edge tile takes its range's), the rest are
        // scanned in block order.
        if (size[i] == k) {
          scalar_t best = -std::numeric_limits<scalar_t>::infinity();
          if (maxima && from == 0 && to == kTile) {
            best = tile_max[i];
          } else {
            for (int64_t jj = from; jj < to; ++jj) best = s[i][jj] > best ? s[i][jj] : best;
          }
          if (!(best > t[k - 1])) continue;
        }
        int64_t* p = out + (a + i) * k;
        for (int64_t jj = from; jj < to; ++jj) {
          const scalar_t v = s[i][jj];
          if (std::isfinite(v) && (size[i] < k || v > t[k - 1])) sheafgnn::insert(v, j0 + jj, t, p, size[i], k);
        }
      }
    }
    for (int64_t i = 0; i < rows; ++i) {
      std::fill(out + (a + i) * k + size[i], out + (a + i + 1) * k, int64_t(-1));
    }
  }
}

torch::Tensor block_topk(torch::Tensor query, torch::Tensor keys, torch::Tensor first, torch::Tensor last,
                         int64_t k) {
  TORCH_CHECK(query.dim() == 2 && keys.dim() == 2 && query.size(1) == keys.size(1),
              "block_topk: expected query (M, r) and keys (J, r), got ", query.sizes(), " and ", keys.sizes());
  TORCH_CHECK(query.scalar_type() == keys.scalar_type(), "block_topk: query and keys dtypes differ");
  TORCH_CHECK(first.numel() == query.size(0) && last.numel() == query.size(0),
              "block_topk: first and last need one entry per query row");
  TORCH_CHECK(k >= 1, "block_topk: k must be >= 1");
  TORCH_CHECK(query.device().is_cpu() && keys.device().is_cpu(), "block_topk: CPU tensors only");
  query = query.contiguous();
  first = first.to(torch::kLong).contiguous();
  last = last.to(torch::kLong).contiguous();
  const int64_t M = query.size(0), r = query.size(1), J = keys.size(0);
  auto out = torch::empty({M, k}, query.options().dtype(torch::kLong));
  if (M == 0) return out;
  if (r == 0 || J == 0) return out.fill_(-1);
  // The keys in tiles of kTile blocks, channel-major within a tile (num_tiles, r, kTile), zero-padded: a tile's
  // keys are one contiguous run (the transposed (r, J) layout strides J apart, and a power-of-two J put every
  // channel of a tile in the same L1 set).
  const int64_t num_tiles = (J + kTile - 1) / kTile;
  auto tiles = torch::zeros({num_tiles * kTile, r}, keys.options());
  tiles.narrow(0, 0, J).copy_(keys);
  tiles = tiles.view({num_tiles, kTile, r}).transpose(1, 2).contiguous();  // (num_tiles, r, kTile)
  AT_DISPATCH_FLOATING_TYPES(query.scalar_type(), "block_topk", [&] {
    const scalar_t* q = query.data_ptr<scalar_t>();
    const scalar_t* kt = tiles.data_ptr<scalar_t>();
    const int64_t* f = first.data_ptr<int64_t>();
    const int64_t* l = last.data_ptr<int64_t>();
    int64_t* o = out.data_ptr<int64_t>();
    // Tasks of 64 rows, handed out so that each thread's contiguous share of tasks mixes early and late rows:
    // rows in position order have ever longer ranges, and a split into contiguous halves gave one thread 3/4.
    const int64_t rows_per_task = 64, num_tasks = (M + rows_per_task - 1) / rows_per_task;
    at::parallel_for(0, num_tasks, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t chunk = t % 2 == 0 ? t / 2 : num_tasks - 1 - t / 2;
        const int64_t row0 = chunk * rows_per_task;
        block_topk_rows<scalar_t>(q, kt, f, l, o, r, J, k, row0, std::min(M, row0 + rows_per_task));
      }
    });
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("block_topk", &block_topk, "The k best blocks of every query row (see block_topk.cpp)");
}
