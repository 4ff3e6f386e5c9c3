/* Crash and stall points for the crash-consistency and stall tests: a no-op
 * unless CXLKV_CRASH_AT or CXLKV_PAUSE_AT names a site. */
#include "core.h"

#include <signal.h>
#include <stdlib.h>
#include <string.h>

/* Test hooks at named sites: CXLKV_CRASH_AT=site:N SIGKILLs the process the
 * Nth time it passes `site` (a death); CXLKV_PAUSE_AT=site:N SIGSTOPs it
 * there instead (a stall: the test judges, reaps and SIGCONTs it). */
struct site_hook {
    int parsed;
    char site[64];
    long long left;       /* passes of `site` before the hook fires */
};
static struct site_hook crash, pause_at;

static int
site_hook_fires(struct site_hook *h, const char *env, const char *site)
{
    if (!h->parsed) {
        h->parsed = 1;
        const char *e = getenv(env);
        const char *colon = e ? strrchr(e, ':') : NULL;
        if (colon && (size_t)(colon - e) < sizeof(h->site)) {
            memcpy(h->site, e, (size_t)(colon - e));
            h->left = atoll(colon + 1);
        }
    }
    return h->left > 0 && !strcmp(site, h->site) &&
           __atomic_sub_fetch(&h->left, 1, __ATOMIC_SEQ_CST) == 0;
}

void
cxlkv_crashpoint(const char *site)
{
    if (site_hook_fires(&crash, "CXLKV_CRASH_AT", site))
        raise(SIGKILL);
    if (site_hook_fires(&pause_at, "CXLKV_PAUSE_AT", site))
        raise(SIGSTOP);
}

PyObject *
mod_crashpoint(PyObject *self, PyObject *arg)
{
    (void)self;
    const char *site = PyUnicode_AsUTF8(arg);
    if (!site)
        return NULL;
    cxlkv_crashpoint(site);
    Py_RETURN_NONE;
}
