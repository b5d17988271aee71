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
#include "fs.h"

#define PLOT_SCRIPT "ddprun_plot.py"

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
    const char *paths[] = {PLOT_SCRIPT, DDP_PLOT_RELDIR "/" PLOT_SCRIPT,
                           DDP_SOURCE_DIR "/launcher/cmd/" PLOT_SCRIPT};
    if (fs_find_beside_self(paths, 3, R_OK, out, len) == 0) return 0;
    char dir[PATH_MAX];
    fs_self_dir(dir, sizeof dir);
    snprintf(tried, tried_len, "%s/, %s/%s/ and %s/launcher/cmd/", dir, dir, DDP_PLOT_RELDIR,
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
