// A row's list of its k best (score, index) pairs, kept sorted best first: shared by block_topk.cpp and
// step_kernels.cpp (stream_pools), so that both rank equal scores alike (the earlier index first).
#pragma once

#include <cstdint>

namespace sheafgnn {

// Insert (score, index) into a top list of `size` valid entries (capacity k); a full list drops its worst.
// The caller inserts only a score that beats the worst of a full list.
template <typename scalar_t>
inline void insert(scalar_t score, int64_t index, scalar_t* top, int64_t* pick, int64_t& size, int64_t k) {
  int64_t i = size < k ? size++ : k - 1;
  while (i > 0 && top[i - 1] < score) {  // strict: an equal score stays behind the earlier index
    top[i] = top[i - 1];
    pick[i] = pick[i - 1];
    --i;
  }
  top[i] = score;
  pick[i] = index;
}

}  // namespace sheafgnn
