// Weight-only int4 and int8 matrix products for bfloat16 activations on AVX-512 with bfloat16 dot products
// (`vdpbf16ps`): the multiply of every forward of our quantized layers on such CPUs.
//
// torch's CPU kernels (_weight_int4pack_mm_for_cpu, _weight_int8pack_mm) dequantize their weights to float32 again
// for every tile of 4 rows and multiply-add one weight per instruction, so scoring 5 tokens costs twice 4. Here the
// codes become bfloat16 without rounding (int4: q - 8 in [-8, 7]; int8: q in [-127, 127]), a block of them is made
// once and every row multiplies it two weights per instruction, and the scales apply once per group (int4:
// sum_k x_k w_k = s * sum_k x_k (q_k - 8) + z * sum_k x_k over a group) or once per output (int8).
//
// Invariant: each output element is accumulated in float32 by the same sequence of operations whatever the number
// of rows in the call and whichever rows share it, so a row's result is bitwise the one a one-row call gives.
// Weights are read in the layouts our layers already hold (no second copy):
// - int4: `_convert_weight_to_int4pack_for_cpu`'s AVX-512 layout: per block of 64 output rows, k-major, byte d of
//   input k holding rows d (low nibble) and d + 32 (high nibble); scales_zeros [K / group, N, 2] bfloat16 (s, z),
//   w = (q - 8) * s + z;
// - int8: codes [N, K] int8 and one bfloat16 scale per output row, w = q * s.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t BLOCK_N = 64;  // int4: output rows per packed block
constexpr int64_t ROWS = 6;      // activation rows whose accumulators sit in registers at once
constexpr int64_t QUAD = 4;      // int8: output rows multiplied together

inline __m512 dot(__m512 acc, __m512i a, __m512i b) {  // acc[i] += a[2i] b[2i] + a[2i+1] b[2i+1] (bfloat16 pairs)
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

inline void store_bf16(at::BFloat16* dst, __m512 values) {
  __m256bh rounded = _mm512_cvtneps_pbh(values);  // round to nearest even
  std::memcpy(dst, &rounded, 32);
}

// The int4 kernel keeps 64 outputs in 4 float32 vectors in the order the byte interleave leaves them: kernel vector
// 2i holds lanes 0-7 of natural vectors 2i and 2i + 1, vector 2i + 1 their lanes 8-15. The same shuffle maps natural
// order to kernel order and back.
inline void reorder(const __m512 in[4], __m512 out[4]) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  out[0] = _mm512_permutex2var_ps(in[0], first, in[1]);
  out[1] = _mm512_permutex2var_ps(in[0], second, in[1]);
  out[2] = _mm512_permutex2var_ps(in[2], first, in[3]);
  out[3] = _mm512_permutex2var_ps(in[2], second, in[3]);
}

// bfloat16 q - 8 of input pairs (k, k + 1), k = 0, 2, .., group - 2, for 64 outputs: codes[(k / 2) * 4 + j]
void int4_codes(const uint8_t* packed, int64_t group, __m512i* codes) {
  alignas(64) static const uint16_t values[32] = {
      0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80,  // -8 .. -1
      0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,  // 0 .. 7
      0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  const __m512i lookup = _mm512_load_si512(values);
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  for (int64_t k = 0; k < group; k += 2) {
    __m256i first = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed + 32 * k));
    __m256i second = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed + 32 * (k + 1)));
    __m256i low0 = _mm256_and_si256(first, nibble), low1 = _mm256_and_si256(second, nibble);
    __m256i high0 = _mm256_and_si256(_mm256_srli_epi16(first, 4), nibble);
    __m256i high1 = _mm256_and_si256(_mm256_srli_epi16(second, 4), nibble);
    __m256i bytes[4] = {_mm256_unpacklo_epi8(low0, low1), _mm256_unpackhi_epi8(low0, low1),
                        _mm256_unpacklo_epi8(high0, high1), _mm256_unpackhi_epi8(high0, high1)};
    for (int j = 0; j < 4; ++j)
      codes[(k / 2) * 4 + j] = _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(bytes[j]), lookup);
  }
}

// acc [R, 64] (kernel order) += s * (x @ (q - 8)) + z * sum(x) over one group, for R rows of x
template <int R>
void int4_rows(const at::BFloat16* x, int64_t stride, const float* x_sums, int64_t sums_stride,
               const __m512i* codes, int64_t group, const __m512 scale[4], const __m512 zero[4], float* acc) {
  __m512 sums[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) sums[r][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < group / 2; ++p) {
    for (int r = 0; r < R; ++r) {
      uint32_t bits;
      std::memcpy(&bits, x + stride * r + 2 * p, 4);
      __m512i pair = _mm512_set1_epi32(static_cast<int>(bits));
      for (int j = 0; j < 4; ++j) sums[r][j] = dot(sums[r][j], codes[4 * p + j], pair);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m512 total = _mm512_set1_ps(x_sums[sums_stride * r]);
    for (int j = 0; j < 4; ++j) {
      __m512 a = _mm512_fmadd_ps(sums[r][j], scale[j], _mm512_loadu_ps(acc + 64 * r + 16 * j));
      _mm512_storeu_ps(acc + 64 * r + 16 * j, _mm512_fmadd_ps(total, zero[j], a));
    }
  }
}

void int4_tile(const at::BFloat16* x, int64_t stride, const float* x_sums, int64_t sums_stride,
               const __m512i* codes, int64_t group, const __m512 scale[4], const __m512 zero[4], float* acc,
               int64_t rows) {
  switch (rows) {
    case 1: return int4_rows<1>(x, stride, x_sums, sums_stride, codes, group, scale, zero, acc);
    case 2: return int4_rows<2>(x, stride, x_sums, sums_stride, codes, group, scale, zero, acc);
    case 3: return int4_rows<3>(x, stride, x_sums, sums_stride, codes, group, scale, zero, acc);
    case 4: return int4_rows<4>(x, stride, x_sums, sums_stride, codes, group, scale, zero, acc);
    case 5: return int4_rows<5>(x, stride, x_sums, sums_stride, codes, group, scale, zero, acc);
    default: return int4_rows<6>(x, stride, x_sums, sums_stride, codes, group, scale, zero, acc);
  }
}

// sums [m, k / group] of x over each group, in float32, in a fixed order
std::vector<float> group_sums(const at::BFloat16* x, int64_t m, int64_t k, int64_t group) {
  std::vector<float> sums(m * (k / group));
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < k / group; ++g) {
      __m512 total = _mm512_setzero_ps();
      for (int64_t i = 0; i < group; i += 16) {
        __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + r * k + g * group + i));
        total = _mm512_add_ps(total, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16)));
      }
      sums[r * (k / group) + g] = _mm512_reduce_add_ps(total);
    }
  return sums;
}

at::Tensor int4_rows_mm(const at::Tensor& x, const at::Tensor& packed, int64_t group, const at::Tensor& scales_zeros) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be [m, k] bfloat16");
  TORCH_CHECK(packed.scalar_type() == at::kByte && scales_zeros.scalar_type() == at::kBFloat16, "bad weight dtypes");
  const int64_t m = x.size(0), k = x.size(1), n = packed.size(0);
  TORCH_CHECK(packed.size(1) * 2 == k && n % BLOCK_N == 0 && group % 16 == 0 && k % group == 0,
              "shapes do not match the int4 layout");
  TORCH_CHECK(scales_zeros.dim() == 3 && scales_zeros.size(0) == k / group && scales_zeros.size(1) == n &&
                  scales_zeros.size(2) == 2, "scales_zeros must be [k / group, n, 2]");
  auto xc = x.contiguous();
  auto pc = packed.contiguous();
  auto szc = scales_zeros.contiguous();
  const at::BFloat16* xs = xc.data_ptr<at::BFloat16>();
  const int64_t groups = k / group;
  std::vector<float> x_sums = group_sums(xs, m, k, group);
  auto out = at::empty({m, n}, x.options());
  const uint8_t* weights = pc.data_ptr<uint8_t>();
  const uint32_t* sz = reinterpret_cast<const uint32_t*>(szc.data_ptr<at::BFloat16>());
  at::BFloat16* result = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, n / BLOCK_N, 1, [&](int64_t begin, int64_t end) {
    std::vector<__m512i> codes(group / 2 * 4);
    std::vector<float> acc(m * BLOCK_N);
    const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    for (int64_t block = begin; block < end; ++block) {
      const int64_t n0 = block * BLOCK_N;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t g = 0; g < groups; ++g) {
        __m512 scale_natural[4], zero_natural[4], scale[4], zero[4];
        for (int j = 0; j < 4; ++j) {  // each uint32 holds (s, z) of one output as two bfloat16
          __m512i pair = _mm512_loadu_si512(sz + g * n + n0 + 16 * j);
          scale_natural[j] = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
          zero_natural[j] = _mm512_castsi512_ps(_mm512_and_si512(pair, high_half));
        }
        reorder(scale_natural, scale);
        reorder(zero_natural, zero);
        int4_codes(weights + n0 * (k / 2) + g * group * 32, group, codes.data());
        for (int64_t r = 0; r < m; r += ROWS)
          int4_tile(xs + r * k + g * group, k, x_sums.data() + r * groups + g, groups, codes.data(), group, scale,
                    zero, acc.data() + r * BLOCK_N, std::min(ROWS, m - r));
      }
      for (int64_t r = 0; r < m; ++r) {
        __m512 kernel_order[4], natural[4];
        for (int j = 0; j < 4; ++j) kernel_order[j] = _mm512_loadu_ps(acc.data() + r * BLOCK_N + 16 * j);
        reorder(kernel_order, natural);
        for (int j = 0; j < 4; ++j) store_bf16(result + r * n + n0 + 16 * j, natural[j]);
      }
    }
  });
  return out;
}

// int8: R rows of x against QUAD output rows of bfloat16 codes [QUAD, k] (k a multiple of 32): raw dot products
template <int R>
void int8_rows(const at::BFloat16* x, int64_t k, const at::BFloat16* codes, float* sums_out) {
  __m512 sums[R][QUAD];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < QUAD; ++i) sums[r][i] = _mm512_setzero_ps();
  for (int64_t c = 0; c < k; c += 32) {
    __m512i w[QUAD];
    for (int i = 0; i < QUAD; ++i) w[i] = _mm512_loadu_si512(codes + i * k + c);
    for (int r = 0; r < R; ++r) {
      __m512i xr = _mm512_loadu_si512(x + r * k + c);
      for (int i = 0; i < QUAD; ++i) sums[r][i] = dot(sums[r][i], w[i], xr);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < QUAD; ++i) sums_out[r * QUAD + i] = _mm512_reduce_add_ps(sums[r][i]);
}

void int8_tile(const at::BFloat16* x, int64_t k, const at::BFloat16* codes, float* sums_out, int64_t rows) {
  switch (rows) {
    case 1: return int8_rows<1>(x, k, codes, sums_out);
    case 2: return int8_rows<2>(x, k, codes, sums_out);
    case 3: return int8_rows<3>(x, k, codes, sums_out);
    case 4: return int8_rows<4>(x, k, codes, sums_out);
    case 5: return int8_rows<5>(x, k, codes, sums_out);
    default: return int8_rows<6>(x, k, codes, sums_out);
  }
}

at::Tensor int8_rows_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be [m, k] bfloat16");
  TORCH_CHECK(codes.scalar_type() == at::kChar && scales.scalar_type() == at::kBFloat16, "bad weight dtypes");
  const int64_t m = x.size(0), k = x.size(1), n = codes.size(0);
  TORCH_CHECK(codes.size(1) == k && k % 32 == 0 && n % QUAD == 0 && scales.numel() == n,
              "shapes do not match the int8 layout");
  auto xc = x.contiguous();
  auto cc = codes.contiguous();
  auto sc = scales.contiguous();
  const at::BFloat16* xs = xc.data_ptr<at::BFloat16>();
  auto out = at::empty({m, n}, x.options());
  const int8_t* weights = cc.data_ptr<int8_t>();
  const at::BFloat16* scale = sc.data_ptr<at::BFloat16>();
  at::BFloat16* result = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, n / QUAD, 16, [&](int64_t begin, int64_t end) {
    std::vector<at::BFloat16> block(QUAD * k);
    float sums[ROWS * QUAD];
    for (int64_t quad = begin; quad < end; ++quad) {
      const int64_t n0 = quad * QUAD;
      for (int64_t i = 0; i < QUAD * k; i += 32) {  // int8 -> bfloat16, exact
        __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(weights + n0 * k + i));
        __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes)));
        __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1)));
        __m512bh both = _mm512_cvtne2ps_pbh(high, low);
        std::memcpy(block.data() + i, &both, 64);
      }
      for (int64_t r = 0; r < m; r += ROWS) {
        const int64_t rows = std::min(ROWS, m - r);
        int8_tile(xs + r * k, k, block.data(), sums, rows);
        for (int64_t rr = 0; rr < rows; ++rr)
          for (int64_t i = 0; i < QUAD; ++i)
            result[(r + rr) * n + n0 + i] = at::BFloat16(sums[rr * QUAD + i] * static_cast<float>(scale[n0 + i]));
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(specsample_rows, m) {
  m.def("int4_rows_mm(Tensor x, Tensor packed, int group, Tensor scales_zeros) -> Tensor");
  m.def("int8_rows_mm(Tensor x, Tensor codes, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(specsample_rows, CPU, m) {
  m.impl("int4_rows_mm", &int4_rows_mm);
  m.impl("int8_rows_mm", &int8_rows_mm);
}
