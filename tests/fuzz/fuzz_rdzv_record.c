/* libFuzzer harness over the rendezvous' record parsers (launcher/rdzv/rdzv_record): the bytes
 * another agent, or anyone who reaches the store, may leave under r<R>/node/<i>, r<R>/rank/<i> and
 * r<R>/restart.
 * Checks that parsing never crashes or reads past the input, and that whatever parses also formats
 * and parses back to the same values. The first byte picks the parser. */
#include <assert.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "rdzv/rdzv_record.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    /* a copy of exactly the input's length: ASan sees any read past it */
    char *text = malloc(size - 1 ? size - 1 : 1);
    memcpy(text, data + 1, size - 1);
    char again[RDZV_RECORD_MAX_BYTES];
    if (data[0] % 3 == 2) {
        rdzv_rank_record_t r, r2;
        if (rdzv_record_rank_parse(text, size - 1, &r)) {
            int n = rdzv_record_rank_format(&r, again, sizeof again);
            assert(n > 0 && rdzv_record_rank_parse(again, (size_t)n, &r2));
            assert(r.group_rank == r2.group_rank && r.rank_offset == r2.rank_offset &&
                   r.world_size == r2.world_size && r.host_join_index == r2.host_join_index &&
                   strcmp(r.error, r2.error) == 0 && (!r.error[0] || r.is_lost == r2.is_lost) &&
                   (r.error[0] ||
                    (strcmp(r.store_host, r2.store_host) == 0 && r.store_port == r2.store_port &&
                     strcmp(r.next_peer_host, r2.next_peer_host) == 0 &&
                     r.next_peer_port == r2.next_peer_port)));
        }
    } else if (data[0] & 1) {
        rdzv_why_t w, w2;
        if (rdzv_record_why_parse(text, size - 1, &w)) {
            int n = rdzv_record_why_format(&w, again, sizeof again);
            assert(n > 0 && rdzv_record_why_parse(again, (size_t)n, &w2));
            assert(w.code == w2.code && w.is_permanent == w2.is_permanent &&
                   w.failures == w2.failures && w.node == w2.node && w.rank == w2.rank);
            char words[128];
            rdzv_record_why_describe(&w, words, sizeof words);
        }
    } else {
        rdzv_node_record_t r, r2;
        if (rdzv_record_node_parse(text, size - 1, &r)) {
            int n = rdzv_record_node_format(&r, again, sizeof again);
            assert(n > 0 && rdzv_record_node_parse(again, (size_t)n, &r2));
            assert(r.nproc == r2.nproc && r.hint == r2.hint && r.is_host == r2.is_host &&
                   strcmp(r.store_host, r2.store_host) == 0 && r.store_port == r2.store_port &&
                   strcmp(r.peer_host, r2.peer_host) == 0 && r.peer_port == r2.peer_port);
        }
    }
    free(text);
    return 0;
}
