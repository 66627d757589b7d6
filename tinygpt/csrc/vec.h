/* Float vectors as wide as the CPU's registers, in GCC's vector extensions, for the kernels'
 * 16-float tile rows (one column of a tile of tinygpt.cpu_kernels.tile: 16 outputs).
 *
 * A tile row is VPT vectors of VW floats: one with AVX-512, two with AVX (ymm registers),
 * four elsewhere (SSE: tinygpt/native.py builds the kernels for x86-64 only). The kernels
 * loop over a tile row's vectors themselves and size their register blocks by VW: a vector
 * type wider than the registers (16 floats on an AVX2 CPU) makes GCC move every operation
 * through the stack, which ran cpu_gemm.c's products at 1.4 GFLOP/s on an AVX2-only AMD
 * EPYC, 2026-11-28 (torch's F.linear: 25-50). In the products each lane does the same
 * arithmetic in the same order whatever VW is, so they have the same bits on every width that
 * fuses the same multiply-adds (tinygpt/native.py keeps GCC from splitting any: its tuning for
 * AMD's Zen cores would, in 128- and 256-bit loops). Loads and stores need no alignment.
 * Shared by cpu_gemv.c, cpu_gemm.c, attention.h, gemm_tiles.h and chunk_attention.h. */
#ifndef TINYGPT_VEC_H
#define TINYGPT_VEC_H

#if defined(__AVX512F__)
#define VW 16
#elif defined(__AVX__)
#define VW 8
#else
#define VW 4
#endif
#define VPT (16 / VW)   /* vectors per 16-float tile row */

typedef float vf __attribute__((vector_size(VW * 4)));
/* the same vector at any float's address, allowed to alias floats (as the intrinsics'
 * unaligned types are): one load or store instruction. A memcpy here became two 16-byte
 * moves through the stack and a 32-byte load of them on the AVX2 EPYC (a stalled store
 * forward per weight vector). */
typedef float vf_at __attribute__((vector_size(VW * 4), aligned(4), may_alias));

static inline vf loadv(const float *p) { return *(const vf_at *)p; }

static inline void storev(float *p, vf v) { *(vf_at *)p = v; }

/* VW 32-bit unsigned integers (bfloat16 pairs), loaded the same way */
typedef unsigned vu __attribute__((vector_size(VW * 4)));
typedef unsigned vu_at __attribute__((vector_size(VW * 4), aligned(4), may_alias));

static inline vu loadu(const unsigned *p) { return *(const vu_at *)p; }

#endif
