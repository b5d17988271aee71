/* Unit tests of proto/exit_codes.h: the one table that tells the agent whether restarting a
 * worker can help. A diverged run (NaN loss) and bad input are final; a lost peer or a bug is not.
 */
#include <criterion/criterion.h>

#include "exit_codes.h"

Test(exit_codes, what_is_not_retried) {
    const int permanent[] = {DDP_EXIT_USAGE,  DDP_EXIT_DATA,     DDP_EXIT_IO,
                             DDP_EXIT_CONFIG, DDP_EXIT_DIVERGED, DDP_EXIT_EXEC_FAILED};
    for (size_t i = 0; i < sizeof permanent / sizeof *permanent; i++)
        cr_assert(ddp_exit_is_permanent(permanent[i]), "exit %d must not be retried", permanent[i]);
}

Test(exit_codes, what_is_retried) {
    /* a peer that died, an internal error, signals (128 + n) and anything unknown: try again */
    const int restartable[] = {1, DDP_EXIT_BUG, DDP_EXIT_PEER_FAILURE, 128 + 9, 128 + 15, 255};
    for (size_t i = 0; i < sizeof restartable / sizeof *restartable; i++)
        cr_assert_not(ddp_exit_is_permanent(restartable[i]), "exit %d must be retried",
                      restartable[i]);
    cr_assert_not(ddp_exit_is_permanent(DDP_EXIT_OK));
}

Test(exit_codes, diverged_has_a_number_of_its_own) {
    const int all[] = {DDP_EXIT_OK,           DDP_EXIT_USAGE,       DDP_EXIT_DATA,
                       DDP_EXIT_BUG,          DDP_EXIT_CANT_CREATE, DDP_EXIT_IO,
                       DDP_EXIT_PEER_FAILURE, DDP_EXIT_CONFIG,      DDP_EXIT_DIVERGED,
                       DDP_EXIT_EXEC_FAILED};
    size_t n = sizeof all / sizeof *all;
    for (size_t i = 0; i < n; i++) {
        cr_assert(all[i] >= 0 && all[i] < 128, "%d would read as a signal", all[i]);
        for (size_t j = i + 1; j < n; j++)
            cr_assert_neq(all[i], all[j]);
    }
    cr_assert_eq(DDP_EXIT_DIVERGED, 80, "documented in docs/ddprun.1 and ddpworker(1)");
}
