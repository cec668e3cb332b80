// Blocked, multi-threaded OUT = A @ B^T with on-the-fly operand decoding.
//
// A is (M, K) and B is (N, K), both contraction-last ("TN"). C is split into
// one rectangle per thread (ChooseGrid); each thread runs the Goto/BLIS loop
// nest (see microkernel.h) on its rectangle with private buffers:
//
//   for mo in rows step MO            (MO = all rows for f32 output)
//     for jc in cols step NC
//       for pc in K step KC
//         decode B[jc:jc+NC, pc:pc+KC] into NR-column panels
//         for ic in mo step MC
//           decode A[ic:ic+MC, pc:pc+KC] into MR-row panels
//           micro-kernels over all NR panels x MR panels
//
// The decoded panels are the only dequantized data (KC x NC and MC x KC per
// thread). FP32 partial sums live in the output itself (f32) or in an
// MO x NC f32 buffer (bf16 output); the last K block writes alpha * sum in
// the output dtype. No thread waits for another inside a call, which keeps
// the kernels fast when the cores are shared with other work.
#ifndef QLAYERS_FFI_CPU_GEMM_DRIVER_H_
#define QLAYERS_FFI_CPU_GEMM_DRIVER_H_

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "../common/elem_format.h"
#include "../common/ffi_util.h"
#include "microkernel.h"
#include "numerics.h"
#include "parallel.h"

namespace qlayers::cpu {

inline constexpr int64_t kMaxKc = 512;

// DeepSeek-V3 style scales: one f32 per (rows_per_scale rows, 128 columns).
struct BlockwiseScales {
  const float* a;
  int64_t a_ld;    // K / 128
  int64_t a_rows;  // 1 or 128
  const float* b;
  int64_t b_ld;
  int64_t b_rows;
};

// Decode rows [r0, r0 + rows) x [k0, k0 + kc) into one micro-panel of R
// rows laid out as dst[k * R + i]; rows past `rows` are zero.
template <class Dec>
inline void PackPanel(const Dec& dec, int64_t r0, int rows, int64_t k0,
                      int64_t kc, int R, float* __restrict dst) {
  for (int i = 0; i < rows; ++i) dec.Decode(r0 + i, k0, kc, dst + i, R);
  for (int i = rows; i < R; ++i) {
    for (int64_t k = 0; k < kc; ++k) dst[k * R + i] = 0.0f;
  }
}

inline void FillOutput(void* out, bool bf16, int64_t count, float value) {
  if (bf16) {
    const uint16_t h = FloatToBf16(value);
    auto* o = static_cast<uint16_t*>(out);
    std::fill(o, o + count, h);
  } else {
    auto* o = static_cast<float*>(out);
    std::fill(o, o + count, value);
  }
}

// Cache blocking of one GEMM call (from the micro-kernel's preferences).
struct Blocking {
  int MR, NR;
  int64_t MC, KC, NC, MO;
};

// One thread's share: the C rectangle [r0, r1) x [c0, c1), computed with the
// sequential blocked algorithm and private panel buffers.
template <class ADec, class BDec>
void GemmRect(const MicroKernel& mk, const Blocking& bl, const ADec& a,
              const BDec& b, int64_t r0, int64_t r1, int64_t c0, int64_t c1,
              int64_t N, int64_t K, float alpha, const BlockwiseScales* bw,
              void* out, bool out_bf16, float* Bp, float* Ap, float* ws) {
  const int MR = bl.MR, NR = bl.NR;
  alignas(64) float rs[64];
  alignas(64) float cs[(kMaxKc / kBlockwiseChunk) * 64];
  for (int64_t mo = r0; mo < r1; mo += bl.MO) {
    const int64_t mrows = std::min(bl.MO, r1 - mo);
    for (int64_t jc = c0; jc < c1; jc += bl.NC) {
      const int64_t nc = std::min(bl.NC, c1 - jc);
      const int64_t npanels = CeilDiv(nc, NR);
      for (int64_t pc = 0; pc < K; pc += bl.KC) {
        const int64_t kc = std::min(bl.KC, K - pc);
        const bool first_k = pc == 0;
        const bool last_k = pc + kc == K;
        const int64_t nch = bw ? kc / kBlockwiseChunk : 0;
        for (int64_t p = 0; p < npanels; ++p) {
          const int rows = static_cast<int>(std::min<int64_t>(NR, nc - p * NR));
          PackPanel(b, jc + p * NR, rows, pc, kc, NR, Bp + p * NR * kc);
        }
        for (int64_t ic = mo; ic < mo + mrows; ic += bl.MC) {
          const int64_t rows_ic = std::min(bl.MC, mo + mrows - ic);
          const int64_t n_ir = CeilDiv(rows_ic, MR);
          for (int64_t ir = 0; ir < n_ir; ++ir) {
            const int rows = static_cast<int>(std::min<int64_t>(MR, rows_ic - ir * MR));
            PackPanel(a, ic + ir * MR, rows, pc, kc, MR, Ap + ir * MR * kc);
          }
          for (int64_t p = 0; p < npanels; ++p) {
            const int n_valid = static_cast<int>(std::min<int64_t>(NR, nc - p * NR));
            const float* bpan = Bp + p * NR * kc;
            const int64_t col0 = jc + p * NR;
            for (int64_t ch = 0; ch < nch; ++ch) {  // column scales per K chunk
              const int64_t chunk = pc / kBlockwiseChunk + ch;
              for (int j = 0; j < NR; ++j) {
                cs[ch * NR + j] =
                    j < n_valid ? bw->b[((col0 + j) / bw->b_rows) * bw->b_ld + chunk] : 0.0f;
              }
            }
            for (int64_t ir = 0; ir < n_ir; ++ir) {
              const int64_t row0 = ic + ir * MR;
              Epilogue ep;
              if (out_bf16) {
                ep.ws = ws + (row0 - mo) * bl.NC + (col0 - jc);
                ep.ld_ws = bl.NC;
                ep.out = static_cast<uint16_t*>(out) + row0 * N + col0;
              } else {
                ep.ws = static_cast<float*>(out) + row0 * N + col0;
                ep.ld_ws = N;
                ep.out = ep.ws;
              }
              ep.ld_out = N;
              ep.alpha = alpha;
              ep.m_valid = static_cast<int>(std::min<int64_t>(MR, rows_ic - ir * MR));
              ep.n_valid = n_valid;
              ep.out_bf16 = out_bf16;
              const float* apan = Ap + ir * MR * kc;
              if (!bw) {
                ep.rs = nullptr;
                ep.cs = nullptr;
                ep.accumulate = !first_k;
                ep.last = last_k;
                mk.fn(kc, apan, bpan, ep);
                continue;
              }
              for (int64_t ch = 0; ch < nch; ++ch) {
                const int64_t chunk = pc / kBlockwiseChunk + ch;
                for (int i = 0; i < MR; ++i) {
                  rs[i] = i < ep.m_valid ? bw->a[((row0 + i) / bw->a_rows) * bw->a_ld + chunk] : 0.0f;
                }
                ep.rs = rs;
                ep.cs = cs + ch * NR;
                ep.accumulate = !(first_k && ch == 0);
                ep.last = last_k && ch == nch - 1;
                mk.fn(kBlockwiseChunk, apan + ch * kBlockwiseChunk * MR,
                      bpan + ch * kBlockwiseChunk * NR, ep);
              }
            }
          }
        }
      }
    }
  }
}

// Splits C into a tm x tn grid of rectangles, one per thread, choosing the
// split that keeps the most threads busy and then decodes the fewest
// operand elements again (every column strip decodes all of its A rows, every
// row strip all of its B rows). Threads never synchronise inside a GEMM.
inline void ChooseGrid(int threads, int64_t M, int64_t N, int MR, int NR,
                       int* tm, int* tn) {
  *tm = *tn = 1;
  int64_t best_used = 1;
  double best_cost = static_cast<double>(M) + static_cast<double>(N);
  for (int m = 1; m <= threads; ++m) {
    const int64_t um = std::min<int64_t>(m, CeilDiv(M, MR));
    const int64_t un = std::min<int64_t>(threads / m, CeilDiv(N, NR));
    const int64_t used = um * un;
    const double cost = static_cast<double>(un) * M + static_cast<double>(um) * N;
    if (used > best_used || (used == best_used && cost < best_cost)) {
      best_used = used;
      best_cost = cost;
      *tm = static_cast<int>(um);
      *tn = static_cast<int>(un);
    }
  }
}

template <class ADec, class BDec>
ffi::Error RunGemm(const ADec& a, const BDec& b, int64_t M, int64_t N,
                   int64_t K, float alpha, const BlockwiseScales* bw,
                   void* out, bool out_bf16) {
  if (M == 0 || N == 0) return ffi::Error::Success();
  if (K == 0) {  // empty sum
    FillOutput(out, out_bf16, M * N, alpha * 0.0f);
    return ffi::Error::Success();
  }
  const MicroKernel& mk = SelectMicroKernel();
  int tm, tn;
  ChooseGrid(ThreadsFor(2.0 * M * N * K, 4.0e6), M, N, mk.mr, mk.nr, &tm, &tn);
  const int64_t rows_per = RoundUp(CeilDiv(M, tm), mk.mr);
  const int64_t cols_per = RoundUp(CeilDiv(N, tn), mk.nr);
  tm = static_cast<int>(CeilDiv(M, rows_per));
  tn = static_cast<int>(CeilDiv(N, cols_per));

  Blocking bl;
  bl.MR = mk.mr;
  bl.NR = mk.nr;
  bl.MC = mk.mc;
  bl.KC = std::min<int64_t>(mk.kc, kMaxKc);
  bl.NC = std::min<int64_t>(mk.nc, cols_per);
  // bf16 output accumulates in an f32 buffer of MO x NC per thread.
  bl.MO = out_bf16 ? std::min<int64_t>(rows_per, RoundUp(1024, bl.MC)) : rows_per;

  const int nthreads = tm * tn;
  const size_t b_size = static_cast<size_t>(bl.KC * bl.NC);
  const size_t a_size = static_cast<size_t>(bl.MC * bl.KC);
  const size_t ws_size = out_bf16 ? static_cast<size_t>(bl.MO * bl.NC) : 0;
  const size_t per_thread = RoundUp(b_size + a_size + ws_size, 16);
  float* scratch = ThreadScratch(per_thread * nthreads);
  if (scratch == nullptr) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      "qlayers: could not allocate GEMM panel buffers");
  }

#pragma omp parallel for num_threads(nthreads) schedule(static, 1)
  for (int t = 0; t < nthreads; ++t) {
    ScopedIeeeSubnormals ieee;
    float* mine = scratch + per_thread * t;
    const int64_t r0 = (t / tn) * rows_per, c0 = (t % tn) * cols_per;
    GemmRect(mk, bl, a, b, r0, std::min(M, r0 + rows_per), c0,
             std::min(N, c0 + cols_per), N, K, alpha, bw, out, out_bf16, mine,
             mine + b_size, mine + b_size + a_size);
  }
  return ffi::Error::Success();
}

}  // namespace qlayers::cpu

#endif  // QLAYERS_FFI_CPU_GEMM_DRIVER_H_
