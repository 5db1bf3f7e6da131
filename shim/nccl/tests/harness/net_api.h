/* The NCCL net-plugin ABI as the harness needs it, written from
 * shared/design/nccl-net-plugin.md (our restatement, not NCCL's headers). The sizes are checked
 * below, so a layout mistake on either side of the boundary fails the build of the harness. */
#ifndef TBRDMA_NET_API_H
#define TBRDMA_NET_API_H

#include <stddef.h>
#include <stdint.h>

typedef int ncclResult_t;
enum { ncclSuccess = 0, ncclSystemError = 2, ncclInternalError = 3, ncclInvalidUsage = 5,
       ncclRemoteError = 6 };
#define NCCL_NET_HANDLE_MAXSIZE 128
#define NCCL_PTR_HOST 0x1
#define NCCL_NET_MAX_REQUESTS 32

typedef void (*ncclDebugLogger_t)(int level, unsigned long flags, const char *file, int line,
                                  const char *fmt, ...);
typedef ncclResult_t (*ncclProfilerCallback_t)(void **eHandle, int type, void *pHandle,
                                               int64_t pluginId, void *extData);
typedef struct { int trafficClass; } ncclNetCommConfig_t;

typedef struct {
  char *name; char *pciPath; uint64_t guid; int ptrSupport; int regIsGlobal; int speed;
  int port; float latency; int maxComms; int maxRecvs; int netDeviceType; int netDeviceVersion;
} ncclNetProperties_v8_t;

typedef struct { int ndevs; int devs[4]; } ncclNetVDeviceProps_v9_t;
typedef struct {
  char *name; char *pciPath; uint64_t guid; int ptrSupport; int regIsGlobal; int forceFlush;
  int speed; int port; float latency; int maxComms; int maxRecvs; int netDeviceType;
  int netDeviceVersion; ncclNetVDeviceProps_v9_t vProps; size_t maxP2pBytes;
  size_t maxCollBytes;
} ncclNetProperties_v9_t;
typedef ncclNetProperties_v9_t ncclNetProperties_v10_t;
typedef struct {
  char *name; char *pciPath; uint64_t guid; int ptrSupport; int regIsGlobal; int forceFlush;
  int speed; int port; float latency; int maxComms; int maxRecvs; int netDeviceType;
  int netDeviceVersion; ncclNetVDeviceProps_v9_t vProps; size_t maxP2pBytes;
  size_t maxCollBytes; int maxMultiRequestSize;
} ncclNetProperties_v11_t;

typedef struct {
  const char *name;
  ncclResult_t (*init)(ncclDebugLogger_t);
  ncclResult_t (*devices)(int *);
  ncclResult_t (*getProperties)(int, ncclNetProperties_v8_t *);
  ncclResult_t (*listen)(int, void *, void **);
  ncclResult_t (*connect)(int, void *, void **, void **);
  ncclResult_t (*accept)(void *, void **, void **);
  ncclResult_t (*regMr)(void *, void *, size_t, int, void **);
  ncclResult_t (*regMrDmaBuf)(void *, void *, size_t, int, uint64_t, int, void **);
  ncclResult_t (*deregMr)(void *, void *);
  ncclResult_t (*isend)(void *, void *, int, int, void *, void **);
  ncclResult_t (*irecv)(void *, int, void **, int *, int *, void **, void **);
  ncclResult_t (*iflush)(void *, int, void **, int *, void **, void **);
  ncclResult_t (*test)(void *, int *, int *);
  ncclResult_t (*closeSend)(void *);
  ncclResult_t (*closeRecv)(void *);
  ncclResult_t (*closeListen)(void *);
  ncclResult_t (*getDeviceMr)(void *, void *, void **);
  ncclResult_t (*irecvConsumed)(void *, int, void *);
} ncclNet_v8_t;

typedef struct {
  const char *name;
  ncclResult_t (*init)(ncclDebugLogger_t);
  ncclResult_t (*devices)(int *);
  ncclResult_t (*getProperties)(int, ncclNetProperties_v9_t *);
  ncclResult_t (*listen)(int, void *, void **);
  ncclResult_t (*connect)(int, void *, void **, void **);
  ncclResult_t (*accept)(void *, void **, void **);
  ncclResult_t (*regMr)(void *, void *, size_t, int, void **);
  ncclResult_t (*regMrDmaBuf)(void *, void *, size_t, int, uint64_t, int, void **);
  ncclResult_t (*deregMr)(void *, void *);
  ncclResult_t (*isend)(void *, void *, size_t, int, void *, void **);
  ncclResult_t (*irecv)(void *, int, void **, size_t *, int *, void **, void **);
  ncclResult_t (*iflush)(void *, int, void **, int *, void **, void **);
  ncclResult_t (*test)(void *, int *, int *);
  ncclResult_t (*closeSend)(void *);
  ncclResult_t (*closeRecv)(void *);
  ncclResult_t (*closeListen)(void *);
  ncclResult_t (*getDeviceMr)(void *, void *, void **);
  ncclResult_t (*irecvConsumed)(void *, int, void *);
  ncclResult_t (*makeVDevice)(int *, ncclNetVDeviceProps_v9_t *);
} ncclNet_v9_t;

typedef struct {
  const char *name;
  ncclResult_t (*init)(ncclDebugLogger_t, ncclProfilerCallback_t);
  ncclResult_t (*devices)(int *);
  ncclResult_t (*getProperties)(int, ncclNetProperties_v10_t *);
  ncclResult_t (*listen)(int, void *, void **);
  ncclResult_t (*connect)(int, ncclNetCommConfig_t *, void *, void **, void **);
  ncclResult_t (*accept)(void *, void **, void **);
  ncclResult_t (*regMr)(void *, void *, size_t, int, void **);
  ncclResult_t (*regMrDmaBuf)(void *, void *, size_t, int, uint64_t, int, void **);
  ncclResult_t (*deregMr)(void *, void *);
  ncclResult_t (*isend)(void *, void *, size_t, int, void *, void *, void **);
  ncclResult_t (*irecv)(void *, int, void **, size_t *, int *, void **, void **, void **);
  ncclResult_t (*iflush)(void *, int, void **, int *, void **, void **);
  ncclResult_t (*test)(void *, int *, int *);
  ncclResult_t (*closeSend)(void *);
  ncclResult_t (*closeRecv)(void *);
  ncclResult_t (*closeListen)(void *);
  ncclResult_t (*getDeviceMr)(void *, void *, void **);
  ncclResult_t (*irecvConsumed)(void *, int, void *);
  ncclResult_t (*makeVDevice)(int *, ncclNetVDeviceProps_v9_t *);
} ncclNet_v10_t;

typedef struct {
  const char *name;
  ncclResult_t (*init)(void **ctx, uint64_t commId, ncclNetCommConfig_t *, ncclDebugLogger_t,
                       ncclProfilerCallback_t);
  ncclResult_t (*devices)(int *);
  ncclResult_t (*getProperties)(int, ncclNetProperties_v11_t *);
  ncclResult_t (*listen)(void *ctx, int, void *, void **);
  ncclResult_t (*connect)(void *ctx, int, void *, void **, void **);
  ncclResult_t (*accept)(void *, void **, void **);
  ncclResult_t (*regMr)(void *, void *, size_t, int, void **);
  ncclResult_t (*regMrDmaBuf)(void *, void *, size_t, int, uint64_t, int, void **);
  ncclResult_t (*deregMr)(void *, void *);
  ncclResult_t (*isend)(void *, void *, size_t, int, void *, void *, void **);
  ncclResult_t (*irecv)(void *, int, void **, size_t *, int *, void **, void **, void **);
  ncclResult_t (*iflush)(void *, int, void **, int *, void **, void **);
  ncclResult_t (*test)(void *, int *, int *);
  ncclResult_t (*closeSend)(void *);
  ncclResult_t (*closeRecv)(void *);
  ncclResult_t (*closeListen)(void *);
  ncclResult_t (*getDeviceMr)(void *, void *, void **);
  ncclResult_t (*irecvConsumed)(void *, int, void *);
  ncclResult_t (*makeVDevice)(int *, ncclNetVDeviceProps_v9_t *);
  ncclResult_t (*finalize)(void *ctx);
  ncclResult_t (*setNetAttr)(void *ctx, void *attr);
} ncclNet_v11_t;

_Static_assert(sizeof(ncclNetProperties_v8_t) == 64, "v8 properties");
_Static_assert(sizeof(ncclNetProperties_v9_t) == 104, "v9 properties");
_Static_assert(offsetof(ncclNetProperties_v9_t, maxP2pBytes) == 88, "v9 maxP2pBytes");
_Static_assert(sizeof(ncclNetProperties_v11_t) == 112, "v11 properties");
_Static_assert(sizeof(ncclNet_v8_t) == 152, "v8 table");
_Static_assert(sizeof(ncclNet_v9_t) == 160, "v9 table");
_Static_assert(sizeof(ncclNet_v10_t) == 160, "v10 table");
_Static_assert(sizeof(ncclNet_v11_t) == 176, "v11 table");

#endif
