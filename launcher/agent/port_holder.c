/* port_holder: see port_holder.h. */
#include "agent/port_holder.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <inttypes.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define MAX_SOCKETS        8
#define TCP_LISTEN         0x0A
#define TCP_CLOSE          0x07
#define TCP_BOUND_INACTIVE 13 /* inet_diag's pseudo-state (Linux >= 6.5): bound only */

typedef struct {
    unsigned long inode;
    int state;
    char remote[64];
    int pid;
    char comm[64];
} holder_socket_t;

static const char *state_name(int st) {
    static const char *const names[] = {"?",          "ESTABLISHED", "SYN_SENT",  "SYN_RECV",
                                        "FIN_WAIT1",  "FIN_WAIT2",   "TIME_WAIT", "CLOSE",
                                        "CLOSE_WAIT", "LAST_ACK",    "LISTEN",    "CLOSING"};
    return st > 0 && st < (int)(sizeof names / sizeof names[0]) ? names[st] : "BOUND";
}

/* "0100007F:1F90" (IPv4, little-endian words) or 32 hex digits (IPv6) -> "127.0.0.1:8080" */
static void format_addr(const char *hex, char *out, size_t out_len) {
    const char *colon = strchr(hex, ':');
    unsigned port = colon ? (unsigned)strtoul(colon + 1, NULL, 16) : 0;
    if (colon && colon - hex == 8) {
        uint32_t a = (uint32_t)strtoul(hex, NULL, 16);
        snprintf(out, out_len, "%u.%u.%u.%u:%u", a & 0xff, (a >> 8) & 0xff, (a >> 16) & 0xff,
                 a >> 24, port);
    } else {
        snprintf(out, out_len, "[ipv6]:%u", port);
    }
}

static int scan_table(const char *path, uint16_t port, holder_socket_t *s, int n) {
    FILE *f = fopen(path, "r");
    if (!f) return n;
    char line[512];
    if (!fgets(line, sizeof line, f)) { /* the header */
        fclose(f);
        return n;
    }
    while (n < MAX_SOCKETS && fgets(line, sizeof line, f)) {
        char local[64], remote[64];
        unsigned st;
        unsigned long inode;
        /* sl local rem st tx:rx tr:when retrnsmt uid timeout inode */
        if (sscanf(line, " %*s %63s %63s %x %*s %*s %*s %*s %*s %lu", local, remote, &st, &inode) !=
            4)
            continue;
        const char *colon = strchr(local, ':');
        if (!colon || strtoul(colon + 1, NULL, 16) != port) continue;
        s[n] = (holder_socket_t){.inode = inode, .state = (int)st};
        format_addr(remote, s[n].remote, sizeof s[n].remote);
        n++;
    }
    fclose(f);
    return n;
}

/* Sockets bound to the port that neither listen nor connect: /proc/net/tcp does not list them,
 * inet_diag does on Linux >= 6.5 (older kernels answer nothing for this state). */
static int scan_bound(int family, uint16_t port, holder_socket_t *s, int n) {
    int fd = socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_SOCK_DIAG);
    if (fd < 0) return n;
    struct {
        struct nlmsghdr nlh;
        struct inet_diag_req_v2 r;
    } req = {.nlh = {.nlmsg_len = sizeof req,
                     .nlmsg_type = SOCK_DIAG_BY_FAMILY,
                     .nlmsg_flags = NLM_F_REQUEST | NLM_F_DUMP},
             .r = {.sdiag_family = (uint8_t)family,
                   .sdiag_protocol = IPPROTO_TCP,
                   .idiag_states = 1u << TCP_BOUND_INACTIVE}};
    struct timeval tv = {1, 0}; /* never hang on the kernel's answer */
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    if (send(fd, &req, sizeof req, 0) < 0) {
        close(fd);
        return n;
    }
    long buf[8192 / sizeof(long)];
    for (bool is_done = false; !is_done;) {
        ssize_t len = recv(fd, buf, sizeof buf, 0);
        if (len <= 0) break;
        for (struct nlmsghdr *h = (struct nlmsghdr *)buf; NLMSG_OK(h, (size_t)len);
             h = NLMSG_NEXT(h, len)) {
            if (h->nlmsg_type == NLMSG_DONE || h->nlmsg_type == NLMSG_ERROR) {
                is_done = true;
                break;
            }
            const struct inet_diag_msg *m = NLMSG_DATA(h);
            if (ntohs(m->id.idiag_sport) != port || n >= MAX_SOCKETS) continue;
            s[n] = (holder_socket_t){.inode = m->idiag_inode, .state = TCP_BOUND_INACTIVE};
            snprintf(s[n].remote, sizeof s[n].remote, "0.0.0.0:0");
            n++;
        }
    }
    close(fd);
    return n;
}

/* Which process holds each socket (inode 0: a socket without an owner, e.g. TIME_WAIT). */
static void find_owners(holder_socket_t *s, int n) {
    DIR *proc = opendir("/proc");
    if (!proc) return;
    struct dirent *p;
    while ((p = readdir(proc))) {
        int pid = atoi(p->d_name);
        if (pid <= 0) continue;
        char dir_path[64];
        snprintf(dir_path, sizeof dir_path, "/proc/%d/fd", pid);
        DIR *fds = opendir(dir_path);
        if (!fds) continue; /* gone, or another user's */
        struct dirent *fd;
        while ((fd = readdir(fds))) {
            char link_path[384], target[64];
            snprintf(link_path, sizeof link_path, "%s/%s", dir_path, fd->d_name);
            ssize_t len = readlink(link_path, target, sizeof target - 1);
            if (len <= 0) continue;
            target[len] = '\0';
            unsigned long inode;
            if (sscanf(target, "socket:[%lu]", &inode) != 1) continue;
            for (int i = 0; i < n; i++) {
                if (s[i].inode != inode || s[i].inode == 0 || s[i].pid) continue;
                s[i].pid = pid;
                char comm_path[64];
                snprintf(comm_path, sizeof comm_path, "/proc/%d/comm", pid);
                FILE *c = fopen(comm_path, "r");
                if (c && fgets(s[i].comm, sizeof s[i].comm, c))
                    s[i].comm[strcspn(s[i].comm, "\n")] = '\0';
                if (c) fclose(c);
            }
        }
        closedir(fds);
    }
    closedir(proc);
}

void port_holder_find(uint16_t port, port_holder_t *out) {
    memset(out, 0, sizeof *out);
    holder_socket_t s[MAX_SOCKETS];
    int n = scan_table("/proc/net/tcp", port, s, 0);
    n = scan_table("/proc/net/tcp6", port, s, n);
    n = scan_bound(AF_INET, port, s, n);
    n = scan_bound(AF_INET6, port, s, n);
    if (n == 0) return;
    out->is_found = true;
    find_owners(s, n);
    size_t used = 0;
    for (int i = 0; i < n && used < sizeof out->text; i++) {
        if (s[i].state == TCP_LISTEN) out->is_listening = true;
        char who[96] = "a process this user cannot see";
        if (s[i].pid)
            snprintf(who, sizeof who, "pid %d (%s)", s[i].pid, s[i].comm);
        else if (s[i].inode == 0)
            snprintf(who, sizeof who, "no process");
        char what[96];
        if (s[i].state == TCP_LISTEN)
            snprintf(what, sizeof what, "listening");
        else if (s[i].state == TCP_BOUND_INACTIVE ||
                 (s[i].state == TCP_CLOSE &&
                  strcmp(s[i].remote + strlen(s[i].remote) - 2, ":0") == 0))
            snprintf(what, sizeof what, "a socket bound to it, neither listening nor connected");
        else
            snprintf(what, sizeof what, "a connection to %s, %s, not listening", s[i].remote,
                     state_name(s[i].state));
        int w = snprintf(out->text + used, sizeof out->text - used, "%s%s: %s", i ? "; " : "", who,
                         what);
        if (w < 0) break;
        used += (size_t)w;
    }
}
