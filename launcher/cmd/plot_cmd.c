/* plot_cmd: `ddprun plot RUN.jsonl... -o curves.png`: runs the plotting script
 * (launcher/cmd/ddprun_plot.py, installed as share/ddprun/ddprun_plot.py) under Python, in place of
 * this process. Owns only finding the script and the interpreter; the script does the work and
 * reports its own errors. */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "commands.h"

#define PLOT_SCRIPT "ddprun_plot.py"

/* dir/name into out when it is a readable file; returns whether it is. */
static int try_path(char *out, size_t len, const char *dir, int dir_len, const char *name) {
    int n = snprintf(out, len, "%.*s/%s", dir_len, dir, name);
    return n > 0 && (size_t)n < len && access(out, R_OK) == 0;
}

/* $DDPRUN_PLOT_SCRIPT, else next to this executable (the build tree has a copy), else where
 * `cmake --install` puts it relative to the executable (DDP_PLOT_RELDIR, ../share/ddprun), else
 * the source tree this was built from. Returns 0, or -ENOENT with the places tried in `tried`. */
static int find_script(char *out, size_t len, char *tried, size_t tried_len) {
    const char *env = getenv("DDPRUN_PLOT_SCRIPT");
    if (env && *env) {
        snprintf(out, len, "%s", env);
        snprintf(tried, tried_len, "%s ($DDPRUN_PLOT_SCRIPT)", env);
        return access(out, R_OK) == 0 ? 0 : -ENOENT;
    }
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    exe[n > 0 ? n : 0] = '\0';
    char *slash = strrchr(exe, '/');
    int dir_len = slash ? (int)(slash - exe) : 1;
    const char *dir = slash ? exe : ".";
    char installed[PATH_MAX];
    snprintf(installed, sizeof installed, "%.*s/%s", dir_len, dir, DDP_PLOT_RELDIR);
    if (try_path(out, len, dir, dir_len, PLOT_SCRIPT) ||
        try_path(out, len, installed, (int)strlen(installed), PLOT_SCRIPT) ||
        try_path(out, len, DDP_SOURCE_DIR "/launcher/cmd",
                 (int)strlen(DDP_SOURCE_DIR "/launcher/cmd"),
                 PLOT_SCRIPT))
        return 0;
    snprintf(tried, tried_len, "%.*s/, %s/ and %s/launcher/cmd/", dir_len, dir, installed,
             DDP_SOURCE_DIR);
    return -ENOENT;
}

int plot_cmd_main(int argc, char **argv) {
    char script[PATH_MAX], tried[3 * PATH_MAX + 64];
    if (find_script(script, sizeof script, tried, sizeof tried) < 0) {
        fprintf(stderr,
                "ddprun plot: cannot find %s (looked in %s); reinstall ddprun or set "
                "DDPRUN_PLOT_SCRIPT\n",
                PLOT_SCRIPT, tried);
        return 1;
    }
    /* Debian's python3-matplotlib lives in /usr/bin/python3's path, which is not always the
     * python3 first on PATH (a virtualenv, pyenv); $DDPRUN_PYTHON chooses another. */
    const char *env = getenv("DDPRUN_PYTHON");
    const char *fallback = access("/usr/bin/python3", X_OK) == 0 ? "/usr/bin/python3" : "python3";
    char python[PATH_MAX];
    snprintf(python, sizeof python, "%s", env && *env ? env : fallback);
    char **args = calloc((size_t)argc + 2, sizeof *args);
    if (!args) {
        fprintf(stderr, "ddprun plot: out of memory\n");
        return 1;
    }
    args[0] = python;
    args[1] = script;
    for (int i = 1; i < argc; i++)
        args[i + 1] = argv[i];
    execvp(python, args);
    fprintf(stderr,
            "ddprun plot: cannot run %s %s: %s (set DDPRUN_PYTHON to a Python 3 "
            "interpreter)\n",
            python, script, strerror(errno));
    free(args);
    return 1;
}
