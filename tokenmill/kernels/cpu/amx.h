// Intel AMX (advanced matrix extensions) tiles for the bfloat16 products of tokenmill's linears.
//
// Where the build has AMX-TILE and AMX-BF16 (-march=native on a host that has them: Sapphire
// Rapids and later) and the kernel lets this process use the tile state, one tdpbf16ps multiplies
// a 16 x 32 bfloat16 tile of x by a 32 x 16 tile of weights into a 16 x 16 float32 tile: 8192
// multiply-adds, against 256 for vdpbf16ps. Measured on one such host (2 vCPUs, KVM): vdpbf16ps
// zmm ran at about 1 per 2 cycles, 64 GFLOP/s a core, a quarter of the float32 FMA rate, where
// tdpbf16ps gave 1,180 GFLOP/s a core; bf16_packed_linear over vdpbf16ps reached 85 GFLOP/s on 2
// cores at 256 rows against 336 for oneDNN.
//
// Weight tiles come straight from the packed layouts: bf16_pack's [N / 16, K / 2, 16, 2] holds, for
// an output tile and 16 consecutive k pairs, 16 rows of 64 bytes (one k pair of 16 channels each),
// which is what tdpbf16ps reads as its second source. x tiles are 16 rows of x, 32 columns each.
//
// Rows: tiles run calls of at least kMinRows rows. Below that the vector paths are faster, with
// weights streamed from memory as in a decode step (measured on the host above, 576 -> 1536 from
// DRAM, 2 threads: bfloat16 at 1 row 93 us on tiles against 77 us on vectors, at 4 rows 85 against
// 94; Q4_1-style grouped codes at 1 row 77 against 48, at 4 rows 81 against 88).
//
// Rounding: a tile product sums its 32 products per output in an order and with an internal
// rounding of its own (measured: not vdpbf16ps's pair by pair float32 rounding). A row's result
// therefore depends on whether its call has fewer than kMinRows rows (vectors) or not (tiles); within
// each side it does not depend on the other rows (each output row of a tile product reads only its
// x row). TOKENMILL_AMX=0 keeps the vectors at every row count: full batch invariance.
#pragma once

#include <cstdint>

// bf16_linear.cpp: from how many rows a bfloat16 call runs on tiles (0 where there are none; whether
// there are: amx_tiles() in kernels.h, which also counts TOKENMILL_AMX).
int64_t amx_min_rows();

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define TOKENMILL_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <strings.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernels.h"

namespace tokenmill_amx {

constexpr int64_t kMinRows = 4;
// Rows of x a GEMM over many rows takes at a time, so that they stay in L2 while weights pass.
constexpr int64_t kChunkRows = 128;

// ldtilecfg's 64-byte operand: palette 1, then per tile its bytes per row and its rows.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64);

// Linux hands a process the tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for
// XTILEDATA, feature 18); once granted it holds for every thread. PyTorch's oneDNN asks the same.
// TOKENMILL_AMX=0 (or false, no), read once per process, keeps the vector paths: the arithmetic of
// hosts without tiles, bit for bit.
inline bool usable() {
  static const bool ok = [] {
    const char* env = std::getenv("TOKENMILL_AMX");
    if (env && (!std::strcmp(env, "0") || !strcasecmp(env, "false") || !strcasecmp(env, "no"))) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// Tiles 0-3 accumulators (16 rows x 16 float32), 4-5 x (16 rows x depth bfloat16), 6-7 weights
// (depth / 2 rows of 16 channel pairs): every kernel here uses this one assignment, depth 32 or 16
// k per product, and `rows` rows of x (16, or fewer for a call of fewer rows: a product's time
// grows with its rows). Loaded per thread (the configuration is thread state) at the start of
// each task.
inline void configure(int depth, int rows = 16) {
  TileConfig c;
  for (int t = 0; t < 4; ++t) c.colsb[t] = 64, c.rows[t] = static_cast<uint8_t>(rows);
  for (int t = 4; t < 6; ++t) c.colsb[t] = static_cast<uint16_t>(depth * 2), c.rows[t] = static_cast<uint8_t>(rows);
  for (int t = 6; t < 8; ++t) c.colsb[t] = 64, c.rows[t] = static_cast<uint8_t>(depth / 2);
  _tile_loadconfig(&c);
}

// Rows of x as tile sources, packed once per call: for each block of 16 rows (the last one padded
// with zero rows) and each 32 columns of K (the last padded with zeros), one tile of 16 rows x 64
// bytes, stored contiguously (1 KB), the blocks' tiles in k order. A call of fewer than 16 rows
// configures its tiles for M rows and packs M rows a tile. A tile load then reads 16 consecutive
// cache lines instead of 16 rows K * 2 bytes apart: on the AMX host (2 threads, weights hot,
// packing included, against the build that read x in place, called alternately in one process)
// bf16_packed_linear ran 1.04-1.33x as fast at 8-64 rows, 1.05-1.10x at 256, 1.02-1.04x at 2048;
// the grouped kernels, bound by their conversions, 0.98-1.05x. The products are the same: so are
// the results, bit for bit.
struct RowTiles {
  const uint16_t* x;  // the packed tiles
  int64_t K, M;
  int64_t blocks() const { return (M + 15) / 16; }
  int tile_rows() const { return M < 16 ? static_cast<int>(M) : 16; }
  // The real rows of row block b (rows 16 b .. 16 b + 15).
  int live(int64_t b) const { return static_cast<int>(M - 16 * b < 16 ? M - 16 * b : 16); }
  // The tile source of row block b from column k (a multiple of 16: products of depth 16 read half
  // of a packed tile's rows), its rows kRowBytes apart.
  const uint16_t* at(int64_t b, int64_t k) const {
    return x + (b * ((K + 31) / 32) + k / 32) * tile_rows() * 32 + k % 32;
  }
};
constexpr int64_t kRowBytes = 64;

// x [M, K] bfloat16 bits packed as RowTiles, into a 64-byte-aligned buffer the calling thread keeps
// between calls (valid until its next call). Calls of 64K elements or more pack their row blocks on the intra-op
// threads.
inline RowTiles row_tiles(const uint16_t* x, int64_t M, int64_t K) {
  thread_local std::vector<uint16_t> buffer;
  const int64_t rows = M < 16 ? M : 16, blocks = (M + 15) / 16, steps = (K + 31) / 32;
  uint16_t* out = aligned_words(buffer, static_cast<size_t>(blocks * steps * rows * 32));
  at::parallel_for(0, blocks, M * K >= (1 << 16) ? 1 : blocks, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t m = 16 * b + r;
        for (int64_t s = 0; s < steps; ++s) {
          uint16_t* dst = out + ((b * steps + s) * rows + r) * 32;
          const int64_t n = m < M ? std::min<int64_t>(32, K - 32 * s) : 0;
          if (n) std::memcpy(dst, x + m * K + 32 * s, static_cast<size_t>(n) * sizeof(uint16_t));
          if (n < 32) std::memset(dst + n, 0, static_cast<size_t>(32 - n) * sizeof(uint16_t));
        }
      }
  });
  return RowTiles{out, K, M};
}

// Row tiles [b0, b1) of xs times one or two weight tiles, accumulated over the whole of K in the
// tiles (configure(32, ...): depth-32 products): 32 rows x 32 channels a step, each x tile used
// twice and each weight tile twice. Weight tile j (w0; w1 unless nullptr) is K / 2 rows of 64
// bytes, bf16_pack's layout of one output tile. store(c, live, b, j) receives each finished block:
// c the 16 x 16 float32 sums (64-byte aligned, row r at c + 16 r), live its real rows, b its row
// tile, j its weight tile. between() runs after each step's products: vector work there overlaps
// the tile unit's (group_linear.cpp makes the next weights so). The products of a row do not
// depend on the other rows.
template <typename Store, typename Between>
inline void rows_2x2(const RowTiles& xs, int64_t b0, int64_t b1, const uint16_t* w0, const uint16_t* w1, int64_t K,
                     Store&& store, Between&& between) {
  alignas(64) float c[4][256];
  for (int64_t b = b0; b < b1; b += 2) {
    const bool two_m = b + 1 < b1;
    const int live0 = xs.live(b), live1 = two_m ? xs.live(b + 1) : 0;
    const uint16_t* x0 = xs.at(b, 0);
    const uint16_t* x1 = two_m ? xs.at(b + 1, 0) : nullptr;
    const int64_t step = xs.tile_rows() * 32;  // one packed tile: the next 32 columns
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = 0; k < K; k += 32) {  // k pairs k / 2 .. k / 2 + 15: 16 rows of 32 words
      _tile_loadd(4, x0 + k / 32 * step, kRowBytes);
      _tile_loadd(6, w0 + k * 16, 64);
      _tile_dpbf16ps(0, 4, 6);
      if (w1) {
        _tile_loadd(7, w1 + k * 16, 64);
        _tile_dpbf16ps(1, 4, 7);
      }
      if (two_m) {
        _tile_loadd(5, x1 + k / 32 * step, kRowBytes);
        _tile_dpbf16ps(2, 5, 6);
        if (w1) _tile_dpbf16ps(3, 5, 7);
      }
      between();
    }
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    _tile_stored(2, c[2], 64);
    _tile_stored(3, c[3], 64);
    for (int rt = 0; rt < (two_m ? 2 : 1); ++rt) {
      store(c[2 * rt], rt ? live1 : live0, b + rt, 0);
      if (w1) store(c[2 * rt + 1], rt ? live1 : live0, b + rt, 1);
    }
  }
}

template <typename Store>
inline void rows_2x2(const RowTiles& xs, int64_t b0, int64_t b1, const uint16_t* w0, const uint16_t* w1, int64_t K,
                     Store&& store) {
  rows_2x2(xs, b0, b1, w0, w1, K, store, [] {});
}

}  // namespace tokenmill_amx
#endif
