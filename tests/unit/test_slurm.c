/* Unit tests of launcher/slurm: the node-list parser (Slurm's compressed forms, widths, products,
 * every malformed form with its message, the host limit), the first host through a stand-in
 * scontrol on PATH or through the parser without one, and the allocation's defaults (which
 * variables win, malformed values, several tasks per node, outside Slurm nothing). */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "slurm.h"

static char out[1 << 16];

static int expand(const char *list, long *n, char *err) {
    err[0] = '\0';
    return slurm_hostlist_expand(list, out, sizeof out, n, err, 256);
}

Test(slurm, expands_the_compressed_forms) {
    const struct {
        const char *list, *hosts;
        long n;
    } cases[] = {
        {"node1", "node1\n", 1},
        {"a,b,c", "a\nb\nc\n", 3},
        {"node[01-04,07]", "node01\nnode02\nnode03\nnode04\nnode07\n", 5},
        {"node[01-04,07],gpu-[1-2]", "node01\nnode02\nnode03\nnode04\nnode07\ngpu-1\ngpu-2\n", 7},
        {"n[8-11]", "n8\nn9\nn10\nn11\n", 4},
        {"n[008-010]", "n008\nn009\nn010\n", 3},
        {"r[1-2]n[1-2]", "r1n1\nr1n2\nr2n1\nr2n2\n", 4},
        {"a[1-2]-ib", "a1-ib\na2-ib\n", 2},
        {"[1-2]x", "1x\n2x\n", 2},
        {"login.cluster.local,c_1[5]", "login.cluster.local\nc_15\n", 2},
        {"x[3,1,2]", "x3\nx1\nx2\n", 3},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        long n = -1;
        char err[256];
        cr_assert_eq(expand(cases[i].list, &n, err), 0, "%s: %s", cases[i].list, err);
        cr_assert_str_eq(out, cases[i].hosts, "%s", cases[i].list);
        cr_assert_eq(n, cases[i].n, "%s: %ld hosts", cases[i].list, n);
    }
}

Test(slurm, refuses_malformed_lists_saying_what_and_where) {
    const struct {
        const char *list, *msg;
    } cases[] = {
        {"", "empty node list"},
        {"a,,b", "empty host name"},
        {"a,", "empty host name"},
        {"node[1-3", "'[' at position 4 is not closed"},
        {"node1-3]", "']' at position 7 has no '['"},
        {"node[]", "empty range at position 5"},
        {"node[1,]", "empty range at position 7"},
        {"node[3-1]", "the range 3-1 at position 5 goes down"},
        {"node[a-3]", "'a' at position 5 is not a digit"},
        {"node[1-]", "is not a number of 1-9 digits"},
        {"node[[1]]", "'[' at position 4 is not closed"},
        {"no de", "' ' at position 2 is not in a host name"},
        {"node;rm", "';' at position 4"},
        {"n[0-99999999]", "more than 100000 hosts"},
        {"a[0-999]b[0-999]", "more than 100000 hosts"},
        {"n[1234567890]", "1-9 digits"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        long n;
        char err[256];
        cr_assert_eq(expand(cases[i].list, &n, err), -EINVAL, "'%s' accepted", cases[i].list);
        cr_assert(strstr(err, cases[i].msg), "'%s': '%s' lacks '%s'", cases[i].list, err,
                  cases[i].msg);
    }
}

Test(slurm, counts_hosts_beyond_the_buffer_and_limits_name_length) {
    char small[16], err[256];
    long n;
    cr_assert_eq(slurm_hostlist_expand("host[1-1000]", small, sizeof small, &n, err, sizeof err),
                 0);
    cr_assert_eq(n, 1000);
    cr_assert_str_eq(small, "host1\nhost2\n", "only whole hosts that fit: '%s'", small);
    char longname[400];
    memset(longname, 'a', sizeof longname - 1);
    longname[sizeof longname - 1] = '\0';
    cr_assert_eq(expand(longname, &n, err), -EINVAL);
    cr_assert(strstr(err, "longer than 255 bytes"), "%s", err);
}

/* A directory holding an executable `scontrol` that runs body; PATH is set to it alone. */
static void fake_scontrol(const char *body) {
    char dir[] = "/tmp/ddp-slurm-XXXXXX";
    cr_assert_not_null(mkdtemp(dir));
    char path[256];
    snprintf(path, sizeof path, "%s/scontrol", dir);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fprintf(f, "#!/bin/sh\n%s\n", body);
    fclose(f);
    chmod(path, 0755);
    setenv("PATH", dir, 1);
}

Test(slurm, first_host_from_scontrol_when_there_is_one) {
    char host[256], err[256] = "";
    fake_scontrol("[ \"$1 $2 $3\" = 'show hostnames odd[1-2]' ] && printf 'from-scontrol\\nx\\n'");
    cr_assert_eq(slurm_first_host("odd[1-2]", host, sizeof host, err, sizeof err), 0, "%s", err);
    cr_assert_str_eq(host, "from-scontrol");
    fake_scontrol("echo 'bad host!'");
    cr_assert_eq(slurm_first_host("odd[3-4]", host, sizeof host, err, sizeof err), 0, "%s", err);
    cr_assert_str_eq(host, "odd3", "scontrol's odd answer is not taken; the parser's is");
    fake_scontrol("exit 1"); /* scontrol without a slurm.conf: the parser */
    cr_assert_eq(slurm_first_host("odd[2-3]", host, sizeof host, err, sizeof err), 0, "%s", err);
    cr_assert_str_eq(host, "odd2");
    cr_assert_eq(slurm_first_host("odd[2-", host, sizeof host, err, sizeof err), -EINVAL);
    cr_assert(strstr(err, "is not closed"), "the parser's message: %s", err);
    setenv("PATH", "/nonexistent", 1); /* no scontrol: the parser */
    cr_assert_eq(slurm_first_host("odd[1-2]", host, sizeof host, err, sizeof err), 0, "%s", err);
    cr_assert_str_eq(host, "odd1");
}

static void allocation(void) {
    setenv("PATH", "/nonexistent", 1);
    setenv("SLURM_JOB_ID", "12345", 1);
    setenv("SLURM_NNODES", "4", 1);
    setenv("SLURM_NODEID", "2", 1);
    setenv("SLURM_JOB_NODELIST", "node[01-04]", 1);
}

static ddprun_opts_t opts;

Test(slurm, the_allocation_becomes_the_rendezvous) {
    allocation();
    char err[512] = "";
    cr_assert_eq(slurm_apply_defaults(&opts, err, sizeof err), 0, "%s", err);
    cr_assert_str_eq(opts.rdzv_backend, "c10d");
    cr_assert_str_eq(opts.rdzv_id, "12345");
    cr_assert_str_eq(opts.rdzv_host, "node01");
    cr_assert_eq(opts.rdzv_port, 29400 + 345);
    cr_assert(opts.has_rdzv_endpoint);
    cr_assert_eq(opts.min_nodes, 4);
    cr_assert_eq(opts.max_nodes, 4);
    cr_assert_eq(opts.node_rank, 2);
    cr_assert_str_eq(opts.master_addr, "node01");
    cr_assert_str_eq(opts.slurm_job_id, "12345");
}

Test(slurm, a_step_s_nodes_win_over_the_job_s) {
    allocation();
    setenv("SLURM_STEP_NODELIST", "node[03-04]", 1);
    setenv("SLURM_STEP_NUM_NODES", "2", 1);
    setenv("SLURM_STEP_NUM_TASKS", "2", 1);
    char err[512] = "";
    cr_assert_eq(slurm_apply_defaults(&opts, err, sizeof err), 0, "%s", err);
    cr_assert_str_eq(opts.rdzv_host, "node03");
    cr_assert_eq(opts.min_nodes, 2);
}

Test(slurm, refuses_malformed_allocations) {
    const struct {
        const char *name, *value, *msg;
    } cases[] = {
        {"SLURM_NNODES", "four", "SLURM_NNODES='four' is not a whole number"},
        {"SLURM_NNODES", "0", "SLURM_NNODES='0'"},
        {"SLURM_NODEID", "-1", "SLURM_NODEID='-1'"},
        {"SLURM_JOB_NODELIST", "node[01-", "SLURM_JOB_NODELIST='node[01-': '[' at position 4"},
        {"SLURM_JOB_ID", "12 345", "SLURM_JOB_ID='12 345' is not a job id"},
        {"SLURM_STEP_NUM_TASKS", "8", "srun started 8 tasks on 4 nodes"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        allocation();
        if (!strcmp(cases[i].name, "SLURM_STEP_NUM_TASKS")) setenv("SLURM_STEP_NUM_NODES", "4", 1);
        setenv(cases[i].name, cases[i].value, 1);
        char err[512] = "";
        cr_assert_eq(slurm_apply_defaults(&opts, err, sizeof err), -EINVAL, "%s=%s accepted",
                     cases[i].name, cases[i].value);
        cr_assert(strstr(err, cases[i].msg), "'%s' lacks '%s'", err, cases[i].msg);
    }
}

Test(slurm, outside_slurm_or_switched_off_nothing_changes) {
    unsetenv("SLURM_JOB_ID");
    unsetenv("SLURM_JOBID");
    ddprun_opts_t before;
    memset(&opts, 0x5a, sizeof opts);
    memcpy(&before, &opts, sizeof opts);
    char err[512];
    cr_assert_eq(slurm_apply_defaults(&opts, err, sizeof err), 0);
    cr_assert_eq(memcmp(&before, &opts, sizeof opts), 0);
    allocation();
    setenv("DDPRUN_SLURM", "0", 1);
    cr_assert_eq(slurm_apply_defaults(&opts, err, sizeof err), 0);
    cr_assert_eq(memcmp(&before, &opts, sizeof opts), 0);
}
