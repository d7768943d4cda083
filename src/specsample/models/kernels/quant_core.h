// Weight-only int4, int8 and bfloat16 matrix products for bfloat16 activations on AVX-512 with bfloat16 dot products
// (`vdpbf16ps`), shared by the per-layer ops (rows_mm.cpp) and the fused decode step (fused_step.cpp).
//
// torch's CPU kernels (_weight_int4pack_mm_for_cpu, _weight_int8pack_mm) dequantize their weights to float32 again
// for every tile of 4 rows and multiply-add one weight per instruction, so scoring 5 tokens costs twice 4. Here
// every row multiplies bfloat16 weights two per instruction, and the scales apply once per group or output:
// - int4 (our layout, packed by models/quant.py): a code q in [0, 15] becomes the bfloat16 128 + q with one bit
//   operation (0x4300 | q), so over a group of inputs sum_k x_k w_k = s * (D - 136 X) + z * X, with
//   w = (q - 8) * s + z, D = sum_k x_k (128 + q_k) and X = sum_k x_k;
// - int8: codes q in [-127, 127] become bfloat16 exactly, a block of them once for every row, w = q * s;
// - bfloat16: the weight itself.
//
// Invariant: each output element is accumulated in float32 by the same sequence of operations whatever the number
// of rows in the call and whichever rows share it, so a row's result is bitwise the one a one-row call gives.
// Layouts:
// - int4: per block of 64 output rows, per 8 inputs, 64 uint32 (four runs of 16 rows); the uint32 of row i holds
//   its 8 codes as nibbles, input 2t in nibble t and input 2t + 1 in nibble t + 4 (t = 0..3), so shifting by 4t and
//   masking 0x000F000F leaves the pair (2t, 2t + 1) in a 32-bit lane as bfloat16 wants it; scales and zeros
//   [n / 64, k / group, 64] as (s, z) bfloat16 pairs, w = (q - 8) * s + z;
// - int8: codes [n, k] int8 and one bfloat16 scale per output row;
// - bfloat16: the weight [n, k].
//
// A product hands each finished tile of outputs, in float32, to an epilogue (store, add a bias, add to the residual
// stream): the tile's values do not depend on what the epilogue does with them.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "pool.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace specsample {

using bf16 = at::BFloat16;

constexpr int64_t BLOCK_N = 64;    // int4: output rows per packed block
constexpr int64_t INT4_ROWS = 4;   // int4: activation rows whose accumulators sit in registers at once
constexpr int64_t ROWS = 6;        // int8 / bfloat16: the same
constexpr int64_t QUAD = 4;
constexpr int64_t PREFETCH = 4096;  // bytes of weights read ahead: streams from memory stay busy      // int8 / bfloat16: output rows multiplied together

inline __m512 dot(__m512 acc, __m512i a, __m512i b) {  // acc[i] += a[2i] b[2i] + a[2i+1] b[2i+1] (bfloat16 pairs)
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

inline void store_bf16(bf16* dst, __m512 values) {
  __m256bh rounded = _mm512_cvtneps_pbh(values);  // round to nearest even
  std::memcpy(dst, &rounded, 32);
}

inline __m512 load_bf16(const bf16* src) {  // 16 bfloat16 -> float32, exact
  __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// acc [R, 64] += s * (D - 136 X) + z * X over each group of `codes` (one block of 64 outputs), for R rows of x
template <int R>
void int4_rows(const bf16* x, int64_t stride, const float* x_sums, int64_t groups, const uint32_t* codes,
               const uint32_t* scales_zeros, int64_t group, float* acc) {
  const __m512i mask = _mm512_set1_epi32(0x000F000F), magic = _mm512_set1_epi32(0x43004300);
  const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m512 offset = _mm512_set1_ps(-136.0f);
  for (int64_t g = 0; g < groups; ++g) {
    __m512 sums[R][4];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) sums[r][j] = _mm512_setzero_ps();
    for (int64_t k8 = g * group / 8; k8 < (g + 1) * group / 8; ++k8) {
      const uint32_t* block = codes + k8 * 64;
      for (int line = 0; line < 4; ++line)  // the codes PREFETCH bytes ahead
        _mm_prefetch(reinterpret_cast<const char*>(block) + PREFETCH + 64 * line, _MM_HINT_T0);
      __m512i packed[4];
      for (int j = 0; j < 4; ++j) packed[j] = _mm512_loadu_si512(block + 16 * j);
      for (int t = 0; t < 4; ++t) {
        __m512i x_pair[R];
        for (int r = 0; r < R; ++r) {
          int32_t bits;
          std::memcpy(&bits, x + stride * r + k8 * 8 + 2 * t, 4);
          x_pair[r] = _mm512_set1_epi32(bits);
        }
        for (int j = 0; j < 4; ++j) {  // (a & b) | c: bfloat16 128 + q of inputs (2t, 2t + 1)
          __m512i weights = _mm512_ternarylogic_epi32(_mm512_srli_epi32(packed[j], 4 * t), mask, magic, 0xEA);
          for (int r = 0; r < R; ++r) sums[r][j] = dot(sums[r][j], weights, x_pair[r]);
        }
      }
    }
    for (int j = 0; j < 4; ++j) {  // each uint32 holds (s, z) of one output as two bfloat16
      __m512i pair = _mm512_loadu_si512(scales_zeros + g * 64 + 16 * j);
      __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
      __m512 zero = _mm512_castsi512_ps(_mm512_and_si512(pair, high_half));
      for (int r = 0; r < R; ++r) {
        __m512 total = _mm512_set1_ps(x_sums[groups * r + g]);
        __m512 codes_sum = _mm512_fmadd_ps(total, offset, sums[r][j]);  // sum_k x_k (q_k - 8)
        __m512 a = _mm512_fmadd_ps(codes_sum, scale, _mm512_loadu_ps(acc + 64 * r + 16 * j));
        _mm512_storeu_ps(acc + 64 * r + 16 * j, _mm512_fmadd_ps(total, zero, a));
      }
    }
  }
}

inline void int4_tile(const bf16* x, int64_t stride, const float* x_sums, int64_t groups, const uint32_t* codes,
                      const uint32_t* scales_zeros, int64_t group, float* acc, int64_t rows) {
  switch (rows) {
    case 1: return int4_rows<1>(x, stride, x_sums, groups, codes, scales_zeros, group, acc);
    case 2: return int4_rows<2>(x, stride, x_sums, groups, codes, scales_zeros, group, acc);
    case 3: return int4_rows<3>(x, stride, x_sums, groups, codes, scales_zeros, group, acc);
    default: return int4_rows<4>(x, stride, x_sums, groups, codes, scales_zeros, group, acc);
  }
}

// sums [m, k / group] of x over each group, in float32, in a fixed order
inline void group_sums(const bf16* x, int64_t m, int64_t k, int64_t group, float* sums) {
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < k / group; ++g) {
      __m512 total = _mm512_setzero_ps();
      for (int64_t i = 0; i < group; i += 16) total = _mm512_add_ps(total, load_bf16(x + r * k + g * group + i));
      sums[r * (k / group) + g] = _mm512_reduce_add_ps(total);
    }
}

// AMX tiles (Sapphire Rapids and later): where the process enabled them (`amx_enabled`, set once at load) every int4
// product runs on them, whatever its number of rows, so the path never depends on the call. A tile multiply takes 16
// rows of x at the cost of about one, which is what makes scoring a block of tokens cheap.
inline bool& amx_enabled() {
  static bool on = false;
  return on;
}

struct TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tiles 0-3: C, rows x 16 float32 (64 outputs); 4: A, rows x 32 bfloat16 of x; 5, 6: B, 16 input pairs x 16 outputs
inline void configure_tiles(int rows) {
  TileConfig config;
  for (int t = 0; t < 5; ++t) config.rows[t] = rows, config.colsb[t] = 64;
  for (int t = 5; t < 7; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  _tile_loadconfig(&config);
}

// acc [row_tiles * tile_rows, 64] += s * (D - 136 X) + z * X over each group of one block of 64 outputs, for x's rows in
// tiles of `tile_rows` (the tiles' configured count). Each group's codes are decoded once, into B tiles in
// `staging` (2 x group / 32 x 4 tiles of 16 x 32 bfloat16: alternate groups alternate halves, so one is decoded while
// the other is read), and multiply every row tile; `results` holds a row tile's 4 C tiles (4 x 16 x 16 float32).
inline void int4_block_amx(const bf16* x, int64_t k, const float* x_sums, int64_t groups, const uint32_t* codes,
                           const uint32_t* scales_zeros, int64_t group, float* acc, int64_t tile_rows,
                           int64_t row_tiles, bf16* staging, float* results) {
  const __m512i mask = _mm512_set1_epi32(0x000F000F), magic = _mm512_set1_epi32(0x43004300);
  const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m512 offset = _mm512_set1_ps(-136.0f);
  const int64_t steps = group / 32;
  for (int64_t g = 0; g < groups; ++g) {
    bf16* tiles = staging + (g % 2) * steps * 2048;
    for (int64_t step = 0; step < steps; ++step)
      for (int64_t quarter = 0; quarter < 4; ++quarter) {  // inputs k0 + 8 quarter .. + 7: B rows 4 quarter + t
        const uint32_t* block = codes + ((g * group + 32 * step) / 8 + quarter) * 64;
        for (int line = 0; line < 4; ++line)
          _mm_prefetch(reinterpret_cast<const char*>(block) + PREFETCH + 64 * line, _MM_HINT_T0);
        __m512i packed[4];
        for (int j = 0; j < 4; ++j) packed[j] = _mm512_loadu_si512(block + 16 * j);
        for (int t = 0; t < 4; ++t)
          for (int j = 0; j < 4; ++j)
            _mm512_store_si512(tiles + step * 2048 + j * 512 + (quarter * 4 + t) * 32,
                               _mm512_ternarylogic_epi32(_mm512_srli_epi32(packed[j], 4 * t), mask, magic, 0xEA));
      }
    __m512 scale[4], zero[4];
    for (int j = 0; j < 4; ++j) {  // each uint32 holds (s, z) of one output as two bfloat16
      __m512i pair = _mm512_loadu_si512(scales_zeros + g * 64 + 16 * j);
      scale[j] = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
      zero[j] = _mm512_castsi512_ps(_mm512_and_si512(pair, high_half));
    }
    for (int64_t tile = 0; tile < row_tiles; ++tile) {
      const bf16* rows = x + tile * tile_rows * k;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t step = 0; step < steps; ++step) {
        const bf16* b = tiles + step * 2048;
        _tile_loadd(4, rows + g * group + 32 * step, k * 2);
        _tile_loadd(5, b, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, b + 512, 64);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(5, b + 1024, 64);
        _tile_dpbf16ps(2, 4, 5);
        _tile_loadd(6, b + 1536, 64);
        _tile_dpbf16ps(3, 4, 6);
      }
      _tile_stored(0, results, 64);
      _tile_stored(1, results + 256, 64);
      _tile_stored(2, results + 512, 64);
      _tile_stored(3, results + 768, 64);
      for (int64_t r = 0; r < tile_rows; ++r) {
        const int64_t row = tile * tile_rows + r;
        const __m512 total = _mm512_set1_ps(x_sums[groups * row + g]);
        for (int j = 0; j < 4; ++j) {
          __m512 codes_sum = _mm512_fmadd_ps(total, offset, _mm512_load_ps(results + j * 256 + r * 16));
          __m512 a = _mm512_fmadd_ps(codes_sum, scale[j], _mm512_loadu_ps(acc + 64 * row + 16 * j));
          _mm512_storeu_ps(acc + 64 * row + 16 * j, _mm512_fmadd_ps(total, zero[j], a));
        }
      }
    }
  }
}

// A weight as one of the layouts above; `kind` says which fields hold it.
struct Weight {
  enum Kind { INT4 = 0, INT8 = 1, BF16 = 2 };
  Kind kind = BF16;
  int64_t n = 0, k = 0, group = 0;  // outputs, inputs, int4 group size
  const uint32_t* int4_packed = nullptr;        // [n / 64, k / 8, 64]
  const uint32_t* int4_scales_zeros = nullptr;  // (s, z) bfloat16 pairs [n / 64, k / group, 64]
  const int8_t* int8_codes = nullptr;
  const bf16* int8_scales = nullptr;
  const bf16* dense = nullptr;  // [n, k]
};

// int8 and bfloat16 weights on tiles, outputs as the tiles' rows: C [16 outputs, columns] += W [16, 32] x^T [32,
// columns] for up to 16 rows of x as columns (tile 0: C, 1: A, the weights as bfloat16, 2: B, x's pairs)
inline void configure_weight_tiles(int columns) {
  TileConfig config;
  config.rows[0] = 16, config.colsb[0] = columns * 4;
  config.rows[1] = 16, config.colsb[1] = 64;
  config.rows[2] = 16, config.colsb[2] = columns * 4;
  _tile_loadconfig(&config);
}

// x's rows [r0, r0 + columns) transposed into B tiles, one per 32 inputs: [k / 32][16 pairs][columns][2] bfloat16
inline void transpose_pairs(const bf16* x, int64_t k, int64_t r0, int64_t columns, bf16* out) {
  const uint32_t* pairs = reinterpret_cast<const uint32_t*>(x);
  uint32_t* dst = reinterpret_cast<uint32_t*>(out);
  for (int64_t p = 0; p < k / 2; ++p)
    for (int64_t c = 0; c < columns; ++c) dst[p * columns + c] = pairs[(r0 + c) * (k / 2) + p];
}

// C [16 outputs, columns] for outputs n0 .. n0 + 15 of an int8 or bfloat16 weight, into `results` (stride columns)
inline void weight_rows_amx(const Weight& w, int64_t n0, const bf16* x_pairs, int64_t columns, bf16* staging,
                            float* results) {
  const int64_t k = w.k;
  _tile_zero(0);
  for (int64_t k0 = 0; k0 < k; k0 += 32) {
    if (w.kind == Weight::INT8) {
      bf16* tile = staging + ((k0 / 32) % 2) * 512;
      const int8_t* codes = w.int8_codes + n0 * k + k0;
      for (int i = 0; i < 16; ++i) {  // int8 -> bfloat16, exact
        _mm_prefetch(reinterpret_cast<const char*>(codes + i * k) + PREFETCH / 4, _MM_HINT_T0);
        __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + i * k));
        __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes)));
        __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1)));
        _mm512_store_si512(tile + i * 32, (__m512i)_mm512_cvtne2ps_pbh(high, low));
      }
      _tile_loadd(1, tile, 64);
    } else {
      _tile_loadd(1, w.dense + n0 * k + k0, k * 2);
    }
    _tile_loadd(2, x_pairs + (k0 / 32) * 16 * columns * 2, columns * 4);
    _tile_dpbf16ps(0, 1, 2);
  }
  _tile_stored(0, results, columns * 4);
}

// y = x @ w^T for x [m, k] bfloat16: for every row r and tile of outputs [j0, j0 + width) (int4: 64 outputs, int8 and
// bfloat16: 4) the epilogue is called as epilogue(r, j0, width, values) with the float32 results in natural order,
// from the thread that computed the tile. `pool`: split the work over our pool (pool.h), else over torch's threads.
// `scratch_sums` holds m * k / group floats (int4's group sums), computed here.
template <class Epilogue>
void project(const bf16* x, int64_t m, const Weight& w, float* scratch_sums, Epilogue&& epilogue, bool pool) {
  // the fused step's products run on our pool; a single product among torch's ops, on torch's threads
  auto parallel_for = [pool](int64_t begin, int64_t end, int64_t grain, const auto& f) {
    if (pool)
      specsample::parallel_for(begin, end, grain, f);
    else
      at::parallel_for(begin, end, grain, f);
  };
  const int64_t k = w.k, n = w.n;
  if (w.kind == Weight::INT4) {
    const int64_t group = w.group, groups = k / group;
    group_sums(x, m, k, group, scratch_sums);
    if (amx_enabled()) {  // rows in tiles of up to 16: past 16, x padded with zero rows to whole tiles
      const int64_t tile_rows = std::min<int64_t>(m, 16), row_tiles = (m + tile_rows - 1) / tile_rows;
      std::vector<bf16> padded_x;
      std::vector<float> padded_sums;
      const bf16* rows = x;
      const float* sums = scratch_sums;
      if (row_tiles * tile_rows != m) {
        padded_x.assign(row_tiles * tile_rows * k, bf16(0.0f));
        std::memcpy(padded_x.data(), x, m * k * sizeof(bf16));
        padded_sums.assign(row_tiles * tile_rows * groups, 0.0f);
        std::memcpy(padded_sums.data(), scratch_sums, m * groups * sizeof(float));
        rows = padded_x.data(), sums = padded_sums.data();
      }
      parallel_for(0, n / BLOCK_N, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> acc(row_tiles * tile_rows * BLOCK_N);
        std::vector<bf16> staging_buffer(2 * (group / 32) * 2048 + 32);
        bf16* staging = reinterpret_cast<bf16*>((reinterpret_cast<uintptr_t>(staging_buffer.data()) + 63) & ~63);
        alignas(64) float results[4 * 16 * 16];
        configure_tiles(static_cast<int>(tile_rows));
        for (int64_t block = begin; block < end; ++block) {
          std::fill(acc.begin(), acc.end(), 0.0f);
          int4_block_amx(rows, k, sums, groups, w.int4_packed + block * (k / 8) * 64,
                         w.int4_scales_zeros + block * groups * 64, group, acc.data(), tile_rows, row_tiles, staging,
                         results);
          for (int64_t r = 0; r < m; ++r) epilogue(r, block * BLOCK_N, BLOCK_N, acc.data() + r * BLOCK_N);
        }
        _tile_release();
      });
      return;
    }
    parallel_for(0, n / BLOCK_N, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> acc(m * BLOCK_N);
      for (int64_t block = begin; block < end; ++block) {
        const uint32_t* codes = w.int4_packed + block * (k / 8) * 64;
        const uint32_t* scales_zeros = w.int4_scales_zeros + block * groups * 64;
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t r = 0; r < m; r += INT4_ROWS)
          int4_tile(x + r * k, k, scratch_sums + r * groups, groups, codes, scales_zeros, group,
                    acc.data() + r * BLOCK_N, std::min(INT4_ROWS, m - r));
        for (int64_t r = 0; r < m; ++r) epilogue(r, block * BLOCK_N, BLOCK_N, acc.data() + r * BLOCK_N);
      }
    });
    return;
  }
  if (amx_enabled()) {  // 16 outputs at a time, x's rows as the tiles' columns, 16 at a time
    for (int64_t r0 = 0; r0 < m; r0 += 16) {
      const int64_t columns = std::min<int64_t>(16, m - r0);
      std::vector<bf16> x_pairs(k * columns);
      transpose_pairs(x, k, r0, columns, x_pairs.data());
      parallel_for(0, n / 16, 4, [&](int64_t begin, int64_t end) {
        alignas(64) bf16 staging[2 * 16 * 32];
        alignas(64) float results[16 * 16];
        configure_weight_tiles(static_cast<int>(columns));
        for (int64_t block = begin; block < end; ++block) {
          const int64_t n0 = block * 16;
          weight_rows_amx(w, n0, x_pairs.data(), columns, staging, results);
          for (int64_t c = 0; c < columns; ++c) {
            float values[16];
            for (int i = 0; i < 16; ++i) {
              values[i] = results[i * columns + c];
              if (w.kind == Weight::INT8) values[i] *= static_cast<float>(w.int8_scales[n0 + i]);
            }
            for (int q = 0; q < 16; q += QUAD) epilogue(r0 + c, n0 + q, QUAD, values + q);
          }
        }
        _tile_release();
      });
    }
    return;
  }
  // int8 and bfloat16: QUAD output rows of bfloat16 weights at a time, each row's dot products over k
  parallel_for(0, n / QUAD, 16, [&](int64_t begin, int64_t end) {
    std::vector<bf16> converted(w.kind == Weight::INT8 ? QUAD * k : 0);
    for (int64_t quad = begin; quad < end; ++quad) {
      const int64_t n0 = quad * QUAD;
      const bf16* block = w.kind == Weight::BF16 ? w.dense + n0 * k : nullptr;
      const char* ahead = w.kind == Weight::INT8 ? reinterpret_cast<const char*>(w.int8_codes + n0 * k)
                                                 : reinterpret_cast<const char*>(block);
      for (int64_t line = 0; line < QUAD * k * (w.kind == Weight::INT8 ? 1 : 2); line += 64)
        _mm_prefetch(ahead + PREFETCH + line, _MM_HINT_T0);  // the weights PREFETCH bytes ahead
      if (w.kind == Weight::INT8) {
        for (int64_t i = 0; i < QUAD * k; i += 32) {  // int8 -> bfloat16, exact
          __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.int8_codes + n0 * k + i));
          __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes)));
          __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1)));
          __m512bh both = _mm512_cvtne2ps_pbh(high, low);
          std::memcpy(converted.data() + i, &both, 64);
        }
        block = converted.data();
      }
      for (int64_t r0 = 0; r0 < m; r0 += ROWS) {
        const int64_t rows = std::min(ROWS, m - r0);
        __m512 sums[ROWS][QUAD];
        for (int64_t r = 0; r < rows; ++r)
          for (int i = 0; i < QUAD; ++i) sums[r][i] = _mm512_setzero_ps();
        for (int64_t c = 0; c < k; c += 32) {
          __m512i wv[QUAD];
          for (int i = 0; i < QUAD; ++i) wv[i] = _mm512_loadu_si512(block + i * k + c);
          for (int64_t r = 0; r < rows; ++r) {
            __m512i xr = _mm512_loadu_si512(x + (r0 + r) * k + c);
            for (int i = 0; i < QUAD; ++i) sums[r][i] = dot(sums[r][i], wv[i], xr);
          }
        }
        for (int64_t r = 0; r < rows; ++r) {
          float values[QUAD];
          for (int i = 0; i < QUAD; ++i) {
            values[i] = _mm512_reduce_add_ps(sums[r][i]);
            if (w.kind == Weight::INT8) values[i] *= static_cast<float>(w.int8_scales[n0 + i]);
          }
          epilogue(r0 + r, n0, QUAD, values);
        }
      }
    }
  });
}

// Checks that the layout fits what `project` reads.
inline void check_weight(const Weight& w) {
  TORCH_CHECK(w.k % 32 == 0, "a projection needs inputs in multiples of 32");
  if (w.kind == Weight::INT4) {
    TORCH_CHECK(w.n % BLOCK_N == 0 && w.group % 32 == 0 && w.k % w.group == 0, "shapes do not match the int4 layout");
  } else {
    TORCH_CHECK(w.k % 32 == 0 && w.n % 16 == 0, "shapes do not match the int8/bfloat16 layout");
  }
}

// the int4 weight from our layout's tensors: packed [n / 64, k / 8, 64] int32, scales_zeros [n / 64, k / group, 64, 2]
// bfloat16
inline Weight int4_weight(const at::Tensor& packed, int64_t group, const at::Tensor& scales_zeros) {
  TORCH_CHECK(packed.scalar_type() == at::kInt && scales_zeros.scalar_type() == at::kBFloat16, "bad int4 dtypes");
  TORCH_CHECK(packed.is_contiguous() && scales_zeros.is_contiguous(), "int4 weights must be contiguous");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 64, "int4 codes must be [n / 64, k / 8, 64]");
  Weight w;
  w.kind = Weight::INT4;
  w.n = packed.size(0) * 64;
  w.k = packed.size(1) * 8;
  w.group = group;
  specsample::check_weight(w);
  TORCH_CHECK(scales_zeros.dim() == 4 && scales_zeros.size(0) == w.n / 64 && scales_zeros.size(1) == w.k / group &&
                  scales_zeros.size(2) == 64 && scales_zeros.size(3) == 2,
              "int4 scales_zeros must be [n / 64, k / group, 64, 2]");
  w.int4_packed = reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>());
  w.int4_scales_zeros = reinterpret_cast<const uint32_t*>(scales_zeros.data_ptr<bf16>());
  return w;
}

}  // namespace specsample
