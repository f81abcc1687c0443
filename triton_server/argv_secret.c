/*
 * Keeps Triton's admin secret off tritonserver's command line.
 *
 * tritonserver (2.51) takes its restricted-API key only as an argument, and a
 * process's arguments are readable by every local user (/proc/PID/cmdline, ps)
 * and by anyone who can inspect its container. Gantry's runtimes start it with
 * this library in LD_PRELOAD, the token GANTRY_SECRET_TOKEN where the rule
 * belongs, and GANTRY_SECRET_FILE naming a file (mode 0600) that holds the
 * rule. Before tritonserver's main() runs, this replaces the token with the
 * file's contents in a copy of argv on the heap: what /proc shows, the
 * original argument area, keeps the token. It then drops the file's name from
 * the environment and itself from LD_PRELOAD, so the processes tritonserver
 * starts (python-backend stubs) neither load it nor learn where the file is.
 *
 * Any other program (mpirun and its daemons, which start tritonserver ranks)
 * passes through untouched and keeps the variables for its children.
 *
 * Fails closed: if the file cannot be read, tritonserver does not start; and if
 * this library is not loaded at all, tritonserver refuses the token itself as
 * a malformed rule.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define GANTRY_SECRET_TOKEN "@gantry-admin-rule@"
#define GANTRY_LIBRARY_PREFIX "gantry-argv-secret"
#define SECRET_MAX 512

typedef int (*main_fn)(int, char **, char **);
typedef int (*start_main_fn)(main_fn, int, char **, void (*)(void), void (*)(void), void (*)(void), void *);

static void refuse(const char *why, const char *path) {
    fprintf(stderr, "gantry: %s %s: tritonserver not started\n", why, path ? path : "");
    _exit(78); /* EX_CONFIG */
}

static size_t read_rule(const char *path, char *rule) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        refuse("cannot open the admin secret file", path);
    size_t size = 0;
    ssize_t got;
    while ((got = read(fd, rule + size, SECRET_MAX - size)) > 0)
        size += (size_t)got;
    close(fd);
    if (got < 0 || size == 0 || size == SECRET_MAX)
        refuse("the admin secret file is unreadable, empty or too long:", path);
    while (size > 0 && (rule[size - 1] == '\n' || rule[size - 1] == '\r'))
        size--;
    rule[size] = '\0';
    return size;
}

/* LD_PRELOAD without this library; other entries (a tcmalloc, say) stay. */
static void drop_self_from_preload(void) {
    const char *preload = getenv("LD_PRELOAD");
    if (preload == NULL)
        return;
    char *kept = calloc(strlen(preload) + 1, 1);
    char *entries = strdup(preload);
    if (kept == NULL || entries == NULL)
        refuse("out of memory reading", "LD_PRELOAD");
    char *save = NULL;
    for (char *entry = strtok_r(entries, ": ", &save); entry; entry = strtok_r(NULL, ": ", &save)) {
        const char *slash = strrchr(entry, '/');
        if (strncmp(slash ? slash + 1 : entry, GANTRY_LIBRARY_PREFIX, strlen(GANTRY_LIBRARY_PREFIX)) == 0)
            continue;
        if (*kept)
            strcat(kept, ":");
        strcat(kept, entry);
    }
    if (*kept)
        setenv("LD_PRELOAD", kept, 1);
    else
        unsetenv("LD_PRELOAD");
    free(entries);
    free(kept);
}

static int is_tritonserver(const char *arg0) {
    const char *slash = strrchr(arg0, '/');
    return strcmp(slash ? slash + 1 : arg0, "tritonserver") == 0;
}

int __libc_start_main(main_fn main, int argc, char **argv, void (*init)(void), void (*fini)(void),
                      void (*rtld_fini)(void), void *stack_end) {
    start_main_fn real = (start_main_fn)dlsym(RTLD_NEXT, "__libc_start_main");
    const char *path = getenv("GANTRY_SECRET_FILE");
    if (real == NULL)
        refuse("cannot find __libc_start_main", NULL);
    if (path != NULL && argc > 0 && is_tritonserver(argv[0])) {
        char rule[SECRET_MAX + 1];
        size_t rule_size = read_rule(path, rule);
        size_t token_size = strlen(GANTRY_SECRET_TOKEN);
        char **copy = calloc((size_t)argc + 1, sizeof *copy);
        if (copy == NULL)
            refuse("out of memory reading", path);
        for (int i = 0; i < argc; i++) {
            char *token = strstr(argv[i], GANTRY_SECRET_TOKEN);
            if (token == NULL) {
                copy[i] = argv[i];
                continue;
            }
            size_t head = (size_t)(token - argv[i]);
            size_t tail = strlen(token + token_size);
            char *arg = malloc(head + rule_size + tail + 1);
            if (arg == NULL)
                refuse("out of memory reading", path);
            memcpy(arg, argv[i], head);
            memcpy(arg + head, rule, rule_size);
            memcpy(arg + head + rule_size, token + token_size, tail + 1);
            copy[i] = arg;
        }
        explicit_bzero(rule, sizeof rule);
        argv = copy;
        unsetenv("GANTRY_SECRET_FILE");
        drop_self_from_preload();
    }
    return real(main, argc, argv, init, fini, rtld_fini, stack_end);
}
