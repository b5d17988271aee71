/* loss_scale_probe INITIAL_SCALE GROWTH_INTERVAL: the worker's loss-scale rule (loss_scale_next)
 * driven from stdin, one found-inf flag (0 or 1) per line; prints "scale good_steps" after each,
 * for tests/interop/test_torch_loss_scale.py to hold against PyTorch's _amp_update_scale_. */
#include <stdio.h>
#include <stdlib.h>

#include "loss_scale.h"

int main(int argc, char **argv) {
    if (argc != 3) {
        fputs("usage: loss_scale_probe INITIAL_SCALE GROWTH_INTERVAL < flags\n", stderr);
        return 2;
    }
    loss_scale_t s = {.scale = strtof(argv[1], NULL)};
    unsigned long interval = strtoul(argv[2], NULL, 10);
    int flag;
    while (scanf("%d", &flag) == 1) {
        s.found_inf = flag != 0;
        loss_scale_next(&s, (uint32_t)interval);
        printf("%.9g %u\n", (double)s.scale, s.good_steps);
    }
    return 0;
}
