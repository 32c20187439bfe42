/* kvmesh bind guard, loaded with LD_PRELOAD into worker processes (kvmesh.transfer.bind_guard).
 * Mooncake binds its transfer listeners to INADDR_ANY (and in6addr_any) whatever address it
 * is given. A bind() to the unspecified address on a port in KVMESH_TRANSFER_BIND_PORTS
 * ("MIN-MAX") is made to the IPv4 address KVMESH_TRANSFER_BIND instead: as is for AF_INET,
 * as its IPv4-mapped address for a dual-stack AF_INET6 socket; a v6-only socket is refused
 * (EADDRNOTAVAIL: it could not serve the IPv4 address). Every other bind() is untouched.
 * Both variables are read at each call (binds are rare), so a worker may set them after load. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);
int kvmesh_bind_guard = 1; /* the worker looks this symbol up to know the guard is loaded */
static bind_fn real_bind;

__attribute__((constructor)) static void resolve(void) { real_bind = (bind_fn)dlsym(RTLD_NEXT, "bind"); }

static int guarded(unsigned port, struct in_addr *host) {
    const char *address = getenv("KVMESH_TRANSFER_BIND"), *range = getenv("KVMESH_TRANSFER_BIND_PORTS");
    unsigned low, high;
    if (!address || !range || inet_pton(AF_INET, address, host) != 1 || sscanf(range, "%u-%u", &low, &high) != 2)
        return 0;
    return low <= port && port <= high;
}

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    struct in_addr host;
    if (!real_bind) resolve();
    if (addr && addr->sa_family == AF_INET && len >= sizeof(struct sockaddr_in)) {
        struct sockaddr_in a;
        memcpy(&a, addr, sizeof a);
        if (a.sin_addr.s_addr == htonl(INADDR_ANY) && guarded(ntohs(a.sin_port), &host)) {
            a.sin_addr = host;
            return real_bind(fd, (const struct sockaddr *)&a, sizeof a);
        }
    } else if (addr && addr->sa_family == AF_INET6 && len >= sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 a;
        memcpy(&a, addr, sizeof a);
        if (IN6_IS_ADDR_UNSPECIFIED(&a.sin6_addr) && guarded(ntohs(a.sin6_port), &host)) {
            int v6only = 0;
            socklen_t size = sizeof v6only;
            if (getsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v6only, &size) != 0 || v6only) {
                errno = EADDRNOTAVAIL;
                return -1;
            }
            memset(&a.sin6_addr, 0, sizeof a.sin6_addr); /* ::ffff:<host> */
            a.sin6_addr.s6_addr[10] = a.sin6_addr.s6_addr[11] = 0xff;
            memcpy(&a.sin6_addr.s6_addr[12], &host, 4);
            return real_bind(fd, (const struct sockaddr *)&a, sizeof a);
        }
    }
    return real_bind(fd, addr, len);
}
