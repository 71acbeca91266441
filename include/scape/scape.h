/*
 * SCAPE comm: public C API.
 *
 * SCAPE comm is a communication library for data-parallel training. This header is its whole
 * public interface: a communicator that ranks create together (NCCL-style unique id, or from the
 * launcher's environment), and collectives on host memory. The sparse SCAPE collectives
 * (agreed masks, values-only exchange) extend the same calls through the `mask` argument.
 *
 * Conventions that hold for every function below
 * ----------------------------------------------
 * - Every function returns a scapeResult_t. Output arguments are written only on success.
 * - When a call on a communicator fails, scapeGetLastError(comm) returns a one-line message
 *   that names the function, the argument or peer rank at fault and what was expected.
 *   Calls that fail before a communicator exists (scapeGetUniqueId, scapeCommInit*) record
 *   their message in a per-thread slot read with scapeGetLastError(NULL).
 * - Handles (communicators, masks, requests) are checked before use: passing one that was
 *   destroyed, aborted, already completed, or never created is scapeInvalidArgument (message
 *   in scapeGetLastError(NULL)), never a crash. A destroyed handle's address is kept out of
 *   reuse for the next 4096 handles of its kind destroyed after it, so a stale handle is not
 *   taken for a newer one; beyond that a stale pointer may alias a live handle.
 * - Collective calls are matched across ranks by their order: every rank of a communicator
 *   must issue the same collectives, in the same order, with the same count, datatype, op and
 *   root. A mismatch is detected and reported on every rank, by the mismatched call itself
 *   (scapeInvalidUsage on the ranks that see it, scapeRemoteError on the others, which hear of
 *   it from them), within milliseconds rather than at the timeout: every message carries a
 *   16-bit signature of the call's arguments, a rank whose operation waits more than 50 ms
 *   looks for peers' messages carrying another signature, and broadcasts and count-0 calls
 *   end with a short zero-byte confirmation among all ranks (log2(nranks) rounds) so that no
 *   rank returns before the others agree. The communicator is then unusable (see "Errors").
 *   (A mismatch whose signatures collide, 1 in 65536, goes undetected.)
 * - No call blocks forever. Every wait inside the library has a deadline set by the
 *   communicator's timeout (scapeConfig_t.timeoutMs, SCAPE_TIMEOUT_MS): an operation that makes
 *   no progress for that long fails with scapeTimeout. A peer that dies or aborts makes every
 *   surviving rank's pending operation fail with scapeRemoteError or scapeTimeout.
 *
 * Errors
 * ------
 * Argument errors (scapeInvalidArgument) are detected locally, before anything is sent: the
 * communicator stays usable, but the other ranks are not told. Their matching call fails with
 * scapeTimeout unless the erring rank calls scapeCommAbort, which notifies every peer at once.
 * Any error that happens after communication started (scapeRemoteError, scapeTimeout,
 * scapeSystemError, scapeInternalError, a cross-rank mismatch) puts the communicator in an
 * error state: every later call on it returns the same error, and the only calls that still
 * do anything are scapeGetLastError, the queries and scapeCommAbort / scapeCommDestroy.
 *
 * Thread safety
 * -------------
 * A communicator is not thread-safe: calls on one communicator (and on requests it returned)
 * must be serialised by the caller. Different communicators may be used concurrently from
 * different threads. The one exception is scapeCommAbort, which may be called from another
 * thread while a call on the communicator is blocked (a watchdog thread ending a hung
 * collective): the blocked call returns scapeInvalidUsage within about a second and the
 * abort completes after it has returned. scapeGetErrorString, scapeGetVersion and scapeGetUniqueId
 * are thread-safe.
 *
 * Memory
 * ------
 * Buffers are owned by the caller: host memory, or device memory for the collectives and the
 * optimizer step that say so (see "GPU data path"). The library never keeps a pointer to a
 * caller buffer after the operation that uses it has completed. For non-blocking calls the
 * buffers must stay valid and untouched (send buffers unmodified, receive buffers unread) until
 * scapeTest reports completion or scapeWait returns.
 */
#ifndef SCAPE_SCAPE_H_
#define SCAPE_SCAPE_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define SCAPE_API __attribute__((visibility("default")))
#else
#define SCAPE_API
#endif

/** Library version: SCAPE_MAJOR, SCAPE_MINOR, SCAPE_PATCH and SCAPE_VERSION_STRING come from
 *  scape_version.h, generated from the build's project version and installed beside this
 *  header. SCAPE_VERSION_CODE == major * 10000 + minor * 100 + patch. */
#include <scape/scape_version.h>
#define SCAPE_VERSION_CODE (SCAPE_MAJOR * 10000 + SCAPE_MINOR * 100 + SCAPE_PATCH)

/* ------------------------------------------------------------------------------------------ */
/* Results                                                                                    */
/* ------------------------------------------------------------------------------------------ */

/** Result of every call. The numeric values are stable across releases. */
typedef enum {
  /** The call did what it says. */
  scapeSuccess = 0,
  /** An argument is wrong (NULL pointer, rank >= nranks, unknown datatype or op, ...).
   *  Detected locally; nothing was sent; the communicator stays usable. */
  scapeInvalidArgument = 1,
  /** The arguments are well-formed but the call is not allowed now: a communicator in error
   *  state, pending requests at destroy, ranks that disagree on a collective's arguments. */
  scapeInvalidUsage = 2,
  /** The operating system or the network library refused something (socket, memory, UCX). */
  scapeSystemError = 3,
  /** A peer failed: it died, closed its connection, sent data that failed validation, or
   *  aborted its communicator. The message names the rank. */
  scapeRemoteError = 4,
  /** A deadline passed: a peer did not arrive at bootstrap, or an operation made no progress
   *  for the communicator's timeout. */
  scapeTimeout = 5,
  /** The request is valid but not supported by this build or this version (for example a
   *  non-NULL stream, or a feature compiled out). */
  scapeUnsupported = 6,
  /** A bug in the library. Please report it with the message. */
  scapeInternalError = 7,
  /** Not an error: a non-blocking operation has not completed yet (scapeTest). */
  scapeInProgress = 8,
  scapeNumResults = 9
} scapeResult_t;

/**
 * A static, human-readable name for a result code ("invalid argument", ...). Never NULL;
 * unknown codes give "unknown result". Thread-safe.
 */
SCAPE_API const char* scapeGetErrorString(scapeResult_t result);

/**
 * Writes SCAPE_VERSION_CODE of the library actually loaded into *version.
 * Returns scapeInvalidArgument if version is NULL. Thread-safe.
 */
SCAPE_API scapeResult_t scapeGetVersion(int* version);

/* ------------------------------------------------------------------------------------------ */
/* Types                                                                                      */
/* ------------------------------------------------------------------------------------------ */

/** Element types. Reductions of fp16/bf16 accumulate in fp32 and round to nearest even once
 *  per hop (each partial sum that crosses the wire is rounded to the element type). */
typedef enum {
  scapeFloat32 = 0,
  scapeFloat16 = 1,  /**< IEEE 754 binary16 */
  scapeBfloat16 = 2, /**< bfloat16 (the top 16 bits of an fp32) */
  scapeInt32 = 3,    /**< for counts and indices; sum/max/min wrap like two's complement */
  scapeInt64 = 4,
  /** OCP 8-bit float E4M3 ("E4M3FN": bias 7, largest finite 448, no infinities, NaN
   *  S.1111.111). Sums accumulate in fp32 and round once per hop, like fp16/bf16; a value that
   *  rounds beyond 448 becomes NaN. As an optimizer payload it carries a shared power-of-two
   *  scale (scapeOptimConfig_t.payloadType). */
  scapeFloat8E4M3 = 5,
  /** OCP 8-bit float E5M2 (bias 15, largest finite 57344, IEEE-like infinities and NaN). */
  scapeFloat8E5M2 = 6,
  scapeNumTypes = 7
} scapeDataType_t;

/** Reduction operations. scapeAvg is the sum divided by nranks (for integers: truncated
 *  toward zero). max/min of a NaN follow C's fmaxf/fminf (the non-NaN operand wins). */
typedef enum {
  scapeSum = 0,
  scapeAvg = 1,
  scapeMax = 2,
  scapeMin = 3,
  scapeNumOps = 4
} scapeRedOp_t;

/** Size in bytes of one element of `dtype`, or 0 for an invalid type. Thread-safe. */
SCAPE_API size_t scapeTypeSize(scapeDataType_t dtype);

/** Opaque communicator handle. */
typedef struct scapeComm* scapeComm_t;
/** Opaque agreed-mask handle (the SCAPE sparse exchange). Pass NULL for dense collectives. */
typedef struct scapeMask* scapeMask_t;
/** Opaque handle of a non-blocking operation; see scapeTest / scapeWait. */
typedef struct scapeRequest* scapeRequest_t;

/** Size of a unique id, in bytes. */
#define SCAPE_UNIQUE_ID_BYTES 128

/**
 * Rendezvous token, created by scapeGetUniqueId on one process and copied by the caller to
 * every rank (through MPI, a file, torch's store, ...). It holds the address and port of the
 * rendezvous root and a random 128-bit secret; a peer that does not present the secret is
 * refused. Treat it as a credential: whoever holds it can join the communicator.
 */
typedef struct {
  char internal[SCAPE_UNIQUE_ID_BYTES];
} scapeUniqueId;

/* ------------------------------------------------------------------------------------------ */
/* Configuration                                                                              */
/* ------------------------------------------------------------------------------------------ */

/** How a rank waits for the network. */
typedef enum {
  /** Default: spin while this host has no more ranks than cores, yield otherwise. */
  scapeProgressAuto = 0,
  /** Poll the network continuously: lowest latency, one core per rank. */
  scapeProgressSpin = 1,
  /** Poll, and give the core away (sched_yield, then short sleeps) when nothing happens:
   *  for hosts with more ranks than cores. */
  scapeProgressYield = 2,
  /** Sleep in the kernel until the network has an event (or a short tick passes). Lowest CPU
   *  use, highest latency. Falls back to Yield where a transport cannot wake a sleeper. */
  scapeProgressBlocking = 3,
  scapeNumProgressModes = 4
} scapeProgressMode_t;

/**
 * Device memory from the caller's allocator (scapeConfig_t.deviceAllocator), so that a
 * framework's caching allocator serves, caches and accounts for the library's device memory
 * (the Python package routes it to torch's caching allocator). Without it (alloc or free NULL)
 * the library allocates with cudaMalloc and keeps what it allocated in the communicator's pool
 * between calls (at most a few idle blocks, the smallest beyond them freed), until the
 * communicator and every optimizer and mask made on it are gone.
 *
 * What comes from it: every device buffer the library allocates for a communicator's device
 * work: the temporaries of the device collectives (mask positions, packed values), of the
 * device top-k and of the device optimizer step (its scratch, the top-k's table and scratch,
 * the norm's partial sums), and the device optimizer state (residual, packed momentum, fp32
 * master weights of scapeOptimStepMixed). Not the staging buffers of the UCX device path
 * (page-locked host memory) nor NCCL's own memory.
 *
 * When and on which stream: alloc is called on the thread of the API call that needs the
 * memory, during that call, with the stream the call was given (NULL: the legacy default
 * stream) and the calling thread's current device; the library enqueues the work that uses the
 * memory on that stream after alloc returns. It may be called at any device call, not only the
 * first: the library does not cache what alloc returns, so a caching allocator should.
 *
 * Lifetime: free(user, ptr, bytes, device, stream) gets back a block with the bytes, device and
 * stream its alloc had. When free is called, the library will not touch the block again, and
 * any work of the library that still uses it is queued on that same `stream` (the block may be
 * handed to work enqueued later on that stream: cudaFreeAsync's and torch's caching allocator's
 * rule); work on any other stream that used it has completed. The stream may have been
 * destroyed by then if the caller destroyed it (its work has then completed). free is called
 * for every block by the time the last of the communicator, its optimizers and masks is
 * destroyed, except a block still in use by a stream that did not finish within the
 * communicator's timeout (scapeCommAbort: 200 ms), which is leaked rather than freed under the
 * device. `user` (and the functions) must stay valid until then.
 *
 * Threads: alloc and free of one communicator are never called concurrently (the library
 * serialises them per communicator), but free may run on any thread that calls into the
 * library for that communicator (a later call, scapeCommDestroy / scapeCommAbort,
 * scapeOptimDestroy, scapeMaskDestroy), and the allocators of different communicators may run
 * at the same time. Neither is called from inside a CUDA callback. Neither may call the
 * library.
 *
 * Errors: alloc returns 0 with *ptr set to at least `bytes` of device memory on `device`
 * (aligned at least as cudaMalloc's, 256 bytes), or non-zero on failure (out of memory). The
 * call that needed the memory then fails with scapeSystemError and a message naming the
 * allocator, as it would had cudaMalloc failed. free cannot fail.
 */
typedef struct {
  int (*alloc)(void* user, size_t bytes, int device, void* stream, void** ptr);
  void (*free)(void* user, void* ptr, size_t bytes, int device, void* stream);
  void* user; /**< passed to alloc and free as is */
} scapeDeviceAllocator_t;

/** Marks a field of scapeConfig_t as "not set": the environment or default applies. */
#define SCAPE_CONFIG_UNDEF_INT (-2147483647 - 1)

/**
 * Communicator configuration. Initialise with SCAPE_CONFIG_INITIALIZER, then set the fields
 * you want; every field left unset takes its SCAPE_* environment variable, else the default.
 * A field set in code wins over the environment. The struct is versioned through `size`, so
 * later releases can add fields at the end without breaking callers built against this one.
 *
 * | field        | environment          | default                                          |
 * |--------------|----------------------|--------------------------------------------------|
 * | timeoutMs    | SCAPE_TIMEOUT_MS     | 120000 (ms with no progress before scapeTimeout)  |
 * | progressMode | SCAPE_PROGRESS       | auto (values: auto, spin, yield, blocking)        |
 * | netIf        | SCAPE_SOCKET_IFNAME  | first interface that is up and not loopback, else lo |
 * | deviceAllocator | (none)            | the library's own pool (see scapeDeviceAllocator_t) |
 */
typedef struct {
  size_t size;      /**< sizeof(scapeConfig_t); set by SCAPE_CONFIG_INITIALIZER */
  unsigned magic;   /**< SCAPE_CONFIG_MAGIC; set by SCAPE_CONFIG_INITIALIZER */
  unsigned version; /**< SCAPE_VERSION_CODE the caller was built with */
  /** Deadline in milliseconds (> 0): an operation (bootstrap included) that makes no progress
   *  for this long fails with scapeTimeout. */
  int timeoutMs;
  /** A scapeProgressMode_t. */
  int progressMode;
  /** Network interface for the bootstrap socket and UCX's TCP transport (for example "lo",
   *  "eth0", "ib0"). NULL: environment, then the default. The string is copied at init. */
  const char* netIf;
  /** Device memory from the caller's allocator (see scapeDeviceAllocator_t); copied at init.
   *  Both functions NULL (the initializer): the library's own pool. */
  scapeDeviceAllocator_t deviceAllocator;
} scapeConfig_t;

#define SCAPE_CONFIG_MAGIC 0x5CA9Eu
#define SCAPE_CONFIG_INITIALIZER                                                           \
  {                                                                                        \
    sizeof(scapeConfig_t), SCAPE_CONFIG_MAGIC, SCAPE_VERSION_CODE, SCAPE_CONFIG_UNDEF_INT, \
        SCAPE_CONFIG_UNDEF_INT, NULL, {                                                    \
      NULL, NULL, NULL                                                                     \
    }                                                                                      \
  }

/* ------------------------------------------------------------------------------------------ */
/* Communicator                                                                               */
/* ------------------------------------------------------------------------------------------ */

/**
 * Creates a rendezvous token. Call it on exactly one process per communicator, then hand the
 * token to every rank (that process included) before they call scapeCommInitRank.
 *
 * It opens a listening TCP socket on the configured interface (SCAPE_SOCKET_IFNAME) and starts
 * a background thread that waits for the ranks. The thread ends when the communicator is
 * formed; or when no rank has come within 5 x SCAPE_TIMEOUT_MS; or when, after the first rank
 * came, the others have not all come within the first rank's timeout (config or
 * SCAPE_TIMEOUT_MS), in which case every rank that came gets scapeTimeout naming the missing
 * ranks. One token forms one communicator.
 *
 * @param uniqueId  out: the token. Must not be NULL.
 * @return scapeSuccess; scapeInvalidArgument (NULL); scapeSystemError (no usable interface,
 *         socket or thread failure).
 */
SCAPE_API scapeResult_t scapeGetUniqueId(scapeUniqueId* uniqueId);

/**
 * Joins a communicator of `nranks` ranks as rank `rank`. Collective: every rank calls it with
 * the same token and nranks; it returns when all have arrived and connected, or fails on every
 * rank that arrived if one does not come within the timeout.
 *
 * @param comm      out: the new communicator; must not be NULL. Set only on success.
 * @param nranks    number of ranks, >= 1.
 * @param uniqueId  the token from scapeGetUniqueId.
 * @param rank      this rank, 0 <= rank < nranks, unique across the callers.
 * @return scapeSuccess; scapeInvalidArgument (NULL comm, nranks < 1, rank out of range, a
 *         token that was not made by scapeGetUniqueId); scapeInvalidUsage (ranks disagree on
 *         nranks, or two callers claim the same rank); scapeTimeout (not every rank came);
 *         scapeRemoteError (the root refused us, for example a wrong secret);
 *         scapeSystemError; scapeInvalidUsage also when a SCAPE_* environment variable is
 *         malformed (the message names it and what it accepts).
 */
SCAPE_API scapeResult_t scapeCommInitRank(scapeComm_t* comm, int nranks, scapeUniqueId uniqueId,
                                          int rank);

/** As scapeCommInitRank, with an explicit configuration (NULL means "all defaults").
 *  scapeInvalidArgument if config was not initialised with SCAPE_CONFIG_INITIALIZER or a field
 *  is out of range. A struct from an older release (smaller `size`) is accepted: only the
 *  fields within its size are read, the others take the environment or default.
 *  scapeUnsupported for a struct from a later release (larger `size` and `version`) or from
 *  another major version. */
SCAPE_API scapeResult_t scapeCommInitRankConfig(scapeComm_t* comm, int nranks,
                                                scapeUniqueId uniqueId, int rank,
                                                const scapeConfig_t* config);

/**
 * Joins a communicator described by the launcher's environment. Rank and size come from, in
 * this order: RANK / WORLD_SIZE (torchrun), OMPI_COMM_WORLD_RANK / OMPI_COMM_WORLD_SIZE
 * (Open MPI's mpirun), PMI_RANK / PMI_SIZE, SLURM_PROCID / SLURM_NTASKS (srun).
 *
 * Rank 0 hosts the rendezvous root. Its address is SCAPE_BOOTSTRAP_ADDR ("host:port") if set;
 * otherwise MASTER_ADDR with port MASTER_PORT + 1 (torchrun's own store already holds
 * MASTER_PORT); otherwise, when every rank runs on one host (OMPI_COMM_WORLD_LOCAL_SIZE or
 * SLURM_NNODES say so), 127.0.0.1 with a port derived from the job id; otherwise, under
 * Slurm, the first host of SLURM_STEP_NODELIST. The shared secret is SCAPE_BOOTSTRAP_SECRET
 * (32 hex digits) if set, else it is derived from the job id: that keeps concurrent jobs
 * apart but is no protection against a hostile process on the network; set
 * SCAPE_BOOTSTRAP_SECRET where that matters.
 *
 * @param comm    out: the communicator; must not be NULL.
 * @param config  configuration, or NULL for defaults.
 * @return as scapeCommInitRankConfig; scapeInvalidUsage when no launcher environment is found
 *         (the message says which variables were looked for).
 */
SCAPE_API scapeResult_t scapeCommInitFromEnv(scapeComm_t* comm, const scapeConfig_t* config);

/**
 * Destroys a communicator and frees everything it owns. Local: it does not wait for peers.
 * Returns scapeInvalidUsage (and destroys nothing) while non-blocking requests of this
 * communicator are incomplete or masks created on it still exist; complete / destroy them or
 * use scapeCommAbort. NULL is a no-op; a communicator already destroyed or aborted is
 * scapeInvalidArgument.
 */
SCAPE_API scapeResult_t scapeCommDestroy(scapeComm_t comm);

/**
 * Abandons a communicator at once, from any state: tells every peer (best effort, so that
 * their pending and next operations fail with scapeRemoteError instead of waiting for the
 * timeout), cancels pending requests, and frees everything, including request handles not yet
 * completed and the masks created on it (their handles become invalid; a mask sync in flight
 * is stopped too). NULL is a no-op. Returns scapeSuccess, or scapeInvalidArgument for a
 * communicator already destroyed or aborted, or scapeInvalidUsage while another thread is
 * aborting it.
 *
 * Thread safety: may be called from another thread while one call on the communicator is in
 * progress (typically blocked in a collective, scapeWait or scapeMaskSyncWait). That call
 * notices at its next poll of the network (at most about 20 ms later in blocking progress
 * mode), tells the peers (waiting at most 1 s for the notices to leave) and fails with
 * scapeInvalidUsage, its message in scapeGetLastError(NULL) of the thread that made it (the
 * communicator's own slot is gone with it); scapeCommAbort frees the communicator only after
 * the call has returned; calls that start once the abort has begun fail with
 * scapeInvalidUsage (message in scapeGetLastError(NULL)). If the call does not return within the
 * communicator's timeout plus 10 s, the communicator is leaked instead of freed under it. No call
 * on the communicator may start after scapeCommAbort has returned (the handle is gone).
 */
SCAPE_API scapeResult_t scapeCommAbort(scapeComm_t comm);

/** Writes the number of ranks of `comm` to *nranks. scapeInvalidArgument on NULL. */
SCAPE_API scapeResult_t scapeCommCount(const scapeComm_t comm, int* nranks);
/** Writes this process's rank in `comm` to *rank. scapeInvalidArgument on NULL. */
SCAPE_API scapeResult_t scapeCommUserRank(const scapeComm_t comm, int* rank);

/**
 * Returns the message of the last failed call on `comm` (or, for comm == NULL, the last failed
 * call of this thread that had no communicator: scapeGetUniqueId, scapeCommInit*). The
 * string is owned by the library and valid until the next call on the same communicator (or
 * by the same thread). Never NULL; "" if nothing failed yet.
 */
SCAPE_API const char* scapeGetLastError(scapeComm_t comm);

/** Checks the communicator's error state without communicating: scapeSuccess if usable,
 *  otherwise the error that broke it. */
SCAPE_API scapeResult_t scapeCommGetAsyncError(scapeComm_t comm, scapeResult_t* asyncError);

/* ------------------------------------------------------------------------------------------ */
/* Collectives                                                                                */
/* ------------------------------------------------------------------------------------------ */
/*
 * Common arguments:
 * - count: number of elements (not bytes). 0 is valid and moves no data, but is still a
 *   collective: it completes when every rank has reached it (a zero-byte exchange of
 *   log2(nranks) rounds), so that a rank passing 0 where the others pass 100 is told.
 *   Buffers may be NULL only when count is 0.
 * - dtype, op: see the enums; every rank must pass the same values.
 * - in place: pass the same pointer as sendbuf and recvbuf (all-reduce, broadcast), or
 *   sendbuf == recvbuf + rank * count (all-gather), or recvbuf == sendbuf + rank * recvcount
 *   (reduce-scatter). Any other overlap of send and receive buffers is invalid.
 * - stream: a cudaStream_t (as void*) or NULL. Host buffers with NULL: as described here.
 *   Host buffers with a stream: the call first waits for the stream (a host wait for the
 *   work queued on it before the call), then runs as with NULL. Device buffers: see "GPU
 *   data path" below (the blocking form enqueues on the stream and returns at once).
 * - Results are bit-identical on every rank.
 *
 * Blocking forms return when the operation has completed on this rank. The *Async forms
 * start the operation and return a request in *request; the caller then drives it with
 * scapeTest / scapeWait. Progress is caller-driven: an async operation advances only inside
 * scapeTest, scapeWait or another call on the same communicator. Operations on one
 * communicator complete in the order they were issued.
 */

/**
 * All-reduce: recvbuf[i] = op over ranks of sendbuf[i], for i < count.
 *
 * @param mask  NULL for a dense all-reduce. A non-NULL agreed mask selects the SCAPE sparse
 *              exchange: count must equal the mask's n; only the current mask's positions are
 *              packed, reduced and unpacked, and every other element of recvbuf is left
 *              untouched (in place allowed). With scapeAllReduceAsync the masked values are
 *              packed inside the call, the exchange progresses in scapeTest / scapeWait, and
 *              the unpack into recvbuf runs when the exchange completes (inside the call on
 *              this communicator that completes it); the request keeps its own packing
 *              buffer and the positions it packed, so the mask may be advanced or destroyed
 *              before the request completes. Device buffers (UCX communicator, blocking form):
 *              gather, staged exchange and scatter are enqueued on `stream` and the call
 *              returns (see "GPU data path"); the same bits as on host buffers.
 * @return scapeSuccess; scapeInvalidArgument (NULL buffer with count > 0, bad dtype/op, bad
 *         overlap, NULL comm, count != the mask's n, host and device buffers mixed);
 *         scapeUnsupported (a stream in a build or on a machine without CUDA, device
 *         buffers with the *Async form);
 *         scapeInvalidUsage
 *         (communicator in error state, ranks disagree on count/dtype/op); scapeRemoteError;
 *         scapeTimeout; scapeSystemError.
 */
SCAPE_API scapeResult_t scapeAllReduce(const void* sendbuf, void* recvbuf, size_t count,
                                       scapeDataType_t dtype, scapeRedOp_t op, scapeMask_t mask,
                                       scapeComm_t comm, void* stream);
/** Non-blocking scapeAllReduce; *request receives the handle (must not be NULL). */
SCAPE_API scapeResult_t scapeAllReduceAsync(const void* sendbuf, void* recvbuf, size_t count,
                                            scapeDataType_t dtype, scapeRedOp_t op,
                                            scapeMask_t mask, scapeComm_t comm, void* stream,
                                            scapeRequest_t* request);

/**
 * Reduce-scatter: sendbuf holds nranks * recvcount elements; rank r receives in recvbuf the
 * reduction over ranks of block r (elements [r * recvcount, (r + 1) * recvcount)).
 */
SCAPE_API scapeResult_t scapeReduceScatter(const void* sendbuf, void* recvbuf, size_t recvcount,
                                           scapeDataType_t dtype, scapeRedOp_t op, scapeComm_t comm,
                                           void* stream);
SCAPE_API scapeResult_t scapeReduceScatterAsync(const void* sendbuf, void* recvbuf,
                                                size_t recvcount, scapeDataType_t dtype,
                                                scapeRedOp_t op, scapeComm_t comm, void* stream,
                                                scapeRequest_t* request);

/**
 * All-gather: every rank contributes sendcount elements; recvbuf (nranks * sendcount
 * elements) receives rank r's block at offset r * sendcount, on every rank.
 */
SCAPE_API scapeResult_t scapeAllGather(const void* sendbuf, void* recvbuf, size_t sendcount,
                                       scapeDataType_t dtype, scapeComm_t comm, void* stream);
SCAPE_API scapeResult_t scapeAllGatherAsync(const void* sendbuf, void* recvbuf, size_t sendcount,
                                            scapeDataType_t dtype, scapeComm_t comm, void* stream,
                                            scapeRequest_t* request);

/**
 * Broadcast: `count` elements of the root's sendbuf reach every rank's recvbuf. sendbuf is
 * read on the root only (may be NULL elsewhere); the root may pass sendbuf == recvbuf.
 * @param root  the sending rank, 0 <= root < nranks, the same on every rank.
 */
SCAPE_API scapeResult_t scapeBroadcast(const void* sendbuf, void* recvbuf, size_t count,
                                       scapeDataType_t dtype, int root, scapeComm_t comm,
                                       void* stream);
SCAPE_API scapeResult_t scapeBroadcastAsync(const void* sendbuf, void* recvbuf, size_t count,
                                            scapeDataType_t dtype, int root, scapeComm_t comm,
                                            void* stream, scapeRequest_t* request);

/** Barrier: returns on a rank once every rank has entered the barrier. */
SCAPE_API scapeResult_t scapeBarrier(scapeComm_t comm);
SCAPE_API scapeResult_t scapeBarrierAsync(scapeComm_t comm, scapeRequest_t* request);

/* ------------------------------------------------------------------------------------------ */
/* Requests                                                                                   */
/* ------------------------------------------------------------------------------------------ */

/**
 * Advances the communicator's pending operations and reports whether `request` is complete.
 * Sets *done to 1 and frees the request when it has completed (successfully or not); then
 * the return value is the operation's result and the handle must not be used again. Sets
 * *done to 0 and returns scapeInProgress while it is still running.
 * scapeInvalidArgument for a NULL request or done.
 */
SCAPE_API scapeResult_t scapeTest(scapeRequest_t request, int* done);

/**
 * Waits until `request` completes (within the communicator's timeout), frees it and returns
 * the operation's result. The handle must not be used again. scapeInvalidArgument for NULL.
 */
SCAPE_API scapeResult_t scapeWait(scapeRequest_t request);

/* ------------------------------------------------------------------------------------------ */
/* Agreed masks: the SCAPE sparse exchange                                                    */
/* ------------------------------------------------------------------------------------------ */
/*
 * A mask object describes a flat buffer of n elements (all of a model's parameters, say), cut
 * into segments (tensors) and owned by the ranks in parts, and holds two masks:
 *   - current: the positions the values-only collectives move at this step;
 *   - next:    the positions chosen for the next step, set by each rank for the part it owns
 *              and then all-gathered (scapeMaskSyncStart .. Wait) while the step computes.
 * scapeMaskAdvance makes next current: the mask chosen at step t is used at step t + 1.
 *
 * Ownership. scapeOwnershipShards: the buffer is cut into nranks contiguous, equal shards
 * (ZeRO-1 / distributed optimizer); a segment that crosses a shard boundary is owned piecewise.
 * scapeOwnershipSegments: whole segments are assigned to ranks, largest first, each to the
 * least-loaded rank (ties to the lower rank) - the replicated-optimizer layout. Every rank
 * must build the same layout; scapeMaskCreate checks a 64-bit fingerprint of it across ranks.
 *
 * Mask order. Values-only collectives exchange the k selected positions as a packed array in
 * mask order: by owner rank, then by increasing index. With shard ownership this is simply
 * increasing index. Rank r's part of the packed array starts at the offset given by
 * scapeMaskGetRankCount. Positions are 64-bit global indices into the flat buffer.
 *
 * Threads. A mask belongs to one communicator and follows its rules (not thread-safe; calls
 * on a mask are serialised with the calls on its communicator). The synchronisation itself
 * runs on a private channel driven by a background thread owned by the mask, so it proceeds
 * while the caller computes, without calls into the library. Destroy masks before their
 * communicator.
 */

/** How the owned parts are laid out. */
typedef enum {
  scapeOwnershipShards = 0,   /**< nranks contiguous equal shards of the flat buffer */
  scapeOwnershipSegments = 1, /**< whole segments, balanced by size */
  scapeNumOwnerships = 2
} scapeOwnership_t;

/** Wire encodings of a rank's owned part of the next mask. */
typedef enum {
  scapeMaskEncodingAuto = 0,        /**< the smallest of the others, chosen per rank and sync */
  scapeMaskEncodingBitmap = 1,      /**< one bit per owned element */
  scapeMaskEncodingIndices = 2,     /**< 32-bit local indices */
  scapeMaskEncodingEliasFano = 3,   /**< Elias-Fano code of the sorted local indices */
  scapeMaskEncodingDeltaVarint = 4, /**< gaps between sorted indices, LEB128 varints */
  scapeNumMaskEncodings = 5
} scapeMaskEncoding_t;

/**
 * Creates a mask object. Collective over `comm`: every rank passes the same layout; a rank
 * whose layout differs makes the call fail on every rank with scapeInvalidUsage. Both masks
 * start empty (k = 0).
 *
 * @param mask         out: the new mask.
 * @param n            flat buffer length, 0 <= n < 2^40.
 * @param nsegments    number of segments, >= 1.
 * @param segOffsets   nsegments + 1 offsets: segment s is [segOffsets[s], segOffsets[s+1]);
 *                     segOffsets[0] == 0, non-decreasing, segOffsets[nsegments] == n. Copied.
 * @param denseFlags   NULL, or nsegments bytes: non-zero marks a segment that is always fully
 *                     selected (norms, biases). Copied.
 * @param ownership    a scapeOwnership_t.
 * @param encoding     a scapeMaskEncoding_t used for every sync (Auto recommended).
 * @param comm         the communicator the mask's collectives run on.
 * @return scapeSuccess; scapeInvalidArgument (bad pointer, offsets, ownership, encoding);
 *         scapeInvalidUsage (layouts differ between ranks; the message names a rank);
 *         scapeSystemError; communication errors as for any collective.
 */
SCAPE_API scapeResult_t scapeMaskCreate(scapeMask_t* mask, uint64_t n, int nsegments,
                                        const uint64_t* segOffsets, const uint8_t* denseFlags,
                                        scapeOwnership_t ownership, scapeMaskEncoding_t encoding,
                                        scapeComm_t comm);

/** Destroys a mask (waiting, within the timeout, for a sync in flight). NULL is a no-op; a
 *  mask that was already destroyed (or freed by scapeCommAbort) is scapeInvalidArgument. */
SCAPE_API scapeResult_t scapeMaskDestroy(scapeMask_t mask);

/**
 * The owned part of `rank` as a list of [begin, end) ranges of the flat buffer, in increasing
 * order. Writes at most `capacity` pairs to ranges (2 * capacity uint64_t: begin, end, ...)
 * and the total number of ranges to *count (pass ranges == NULL to query the count).
 */
SCAPE_API scapeResult_t scapeMaskGetOwnedRanges(scapeMask_t mask, int rank, uint64_t* ranges,
                                                size_t capacity, size_t* count);

/**
 * Sets this rank's owned part of the next mask from `k` sorted global indices, all inside the
 * rank's owned ranges, strictly increasing. Positions of always-dense segments are added by
 * the library (do not list them). Local: no communication. k larger than the rank's owned
 * part is scapeInvalidArgument. A rank that starts a sync without setting or selecting its
 * part since the last advance contributes the always-dense segments only (as k = 0 does).
 */
SCAPE_API scapeResult_t scapeMaskSetNextIndices(scapeMask_t mask, const uint64_t* indices,
                                                size_t k);

/**
 * Selects this rank's owned part of the next mask by top-k of |statistic| (for SCAPE:
 * statistic = the candidate c = b1*m + (1-b1)*g + e): for every piece of a segment inside the
 * owned part, k = max(1, floor(density * length)) largest magnitudes (ties to the lower
 * index); always-dense segments entirely. Deterministic. Local. The order is that of the bit
 * pattern of |x|: -0 equals +0, infinity is above every finite value, NaN above infinity, and
 * NaNs order among themselves by their payload bits (as the CPU and CUDA kernels do).
 *
 * @param statistic  the full flat buffer (n floats); only the owned part is read. Host or
 *                   device memory: with a device statistic the top-k runs on the device (the
 *                   default stream: finish writing it before the call) and only the selected
 *                   positions are copied back, a host wait for that copy (within the
 *                   communicator's timeout). The same selection as from host memory.
 * @param density    0 < density <= 1.
 */
SCAPE_API scapeResult_t scapeMaskSelectNextTopk(scapeMask_t mask, const float* statistic,
                                                double density);
/**
 * scapeMaskSelectNextTopk on `stream` (a cudaStream_t; NULL: the default stream, the same as
 * scapeMaskSelectNextTopk): a device statistic's top-k is enqueued on `stream`, after the
 * caller's work there (no need to finish writing the statistic first; the Python binding
 * passes the framework's current stream), and the call waits on the host for the selected
 * positions' copy on that stream (within the communicator's timeout). A host statistic with a
 * non-NULL stream waits for the stream first.
 */
SCAPE_API scapeResult_t scapeMaskSelectNextTopkStream(scapeMask_t mask, const float* statistic,
                                                      double density, void* stream);

/**
 * Starts the all-gather of every rank's owned part of the next mask (encoded as configured).
 * Collective (all ranks start their syncs in the same order). Returns at once: the encoding,
 * the exchange and the decoding all run on the mask's background thread, so the caller's
 * thread does no mask work until scapeMaskAdvance. Until the sync completes the next mask
 * must not change (scapeMaskSetNextIndices and scapeMaskSelectNextTopk return
 * scapeInvalidUsage). scapeInvalidUsage if a sync is already in flight, or if the encoding is
 * scapeMaskEncodingIndices and this rank owns more than 2^32 elements. Errors found on the
 * background thread are returned by scapeMaskSyncTest / scapeMaskSyncWait.
 * The background thread needs a core while it works: encoding and decoding cost a few ns per
 * index and, between ranks on one host, the copies are CPU work too (about 5 ms per sync for
 * 64 Mi elements at density 0.01 and 2 ranks on the development VM). The sync therefore hides
 * behind compute on a device while the calling thread waits, not behind host compute that
 * occupies every core; leave each rank a core for it. It sleeps while it waits for peers.
 */
SCAPE_API scapeResult_t scapeMaskSyncStart(scapeMask_t mask);
/** *done = 1 when the sync started last has completed (then returns its result), else 0 and
 *  scapeInProgress. */
SCAPE_API scapeResult_t scapeMaskSyncTest(scapeMask_t mask, int* done);
/** Waits for the sync in flight (within the communicator's timeout) and returns its result.
 *  Decoding validates everything received; a corrupt part is scapeRemoteError naming the
 *  rank. scapeSuccess at once when no sync is in flight. */
SCAPE_API scapeResult_t scapeMaskSyncWait(scapeMask_t mask);

/** Makes the synchronised next mask current. scapeInvalidUsage while a sync is in flight or
 *  when no sync completed since the last advance. Local and O(1): the mask keeps two index
 *  buffers (8 bytes per position of the current and of the next mask) and swaps them. */
SCAPE_API scapeResult_t scapeMaskAdvance(scapeMask_t mask);

/** Number of positions in the current mask (all ranks' parts). */
SCAPE_API scapeResult_t scapeMaskGetCount(scapeMask_t mask, uint64_t* k);
/** Rank `rank`'s part of the current mask: its count and its offset in mask order. */
SCAPE_API scapeResult_t scapeMaskGetRankCount(scapeMask_t mask, int rank, uint64_t* k,
                                              uint64_t* offset);
/** Copies the current mask's global indices in mask order into `indices` (capacity >= k). */
SCAPE_API scapeResult_t scapeMaskGetIndices(scapeMask_t mask, uint64_t* indices, size_t capacity);

/** What the last completed sync cost this rank. */
typedef struct {
  scapeMaskEncoding_t encoding; /**< encoding this rank sent */
  uint64_t sentBytes;           /**< encoded bytes of this rank's part */
  uint64_t totalBytes;          /**< encoded bytes of all parts (what each rank received) */
  uint64_t bytesByEncoding[scapeNumMaskEncodings]; /**< this rank's part in each encoding
                                                        (index 0 unused) */
  double syncSeconds; /**< from SyncStart to completion in the background */
} scapeMaskSyncInfo_t;
SCAPE_API scapeResult_t scapeMaskGetSyncInfo(scapeMask_t mask, scapeMaskSyncInfo_t* info);

/**
 * Packs `dense` (n elements of dtype) at the current mask's positions into `packed` (k
 * elements, mask order); Unpack writes packed values back to their positions and leaves every
 * other element of `dense` untouched. Local. Both buffers host memory, or both device memory
 * (a mix is scapeInvalidArgument naming both): with device buffers, there being no stream
 * argument, the gather / scatter is enqueued on the default (legacy) stream and the call
 * returns without waiting for it (synchronise the default stream, or use a blocking stream,
 * before reading the result on the host or on a non-blocking stream).
 */
SCAPE_API scapeResult_t scapeMaskPack(scapeMask_t mask, const void* dense, void* packed,
                                      scapeDataType_t dtype);
SCAPE_API scapeResult_t scapeMaskUnpack(scapeMask_t mask, const void* packed, void* dense,
                                        scapeDataType_t dtype);
/**
 * scapeMaskPack / scapeMaskUnpack on `stream` (a cudaStream_t; NULL: the default stream, the
 * same as the forms without it): with device buffers the gather / scatter is enqueued on
 * `stream`, in order with the caller's work there, and the call returns without waiting for
 * it (the Python binding passes the framework's current stream, so a non-blocking stream such
 * as torch's side streams is ordered too). Host buffers with a non-NULL stream wait for it
 * first.
 */
SCAPE_API scapeResult_t scapeMaskPackStream(scapeMask_t mask, const void* dense, void* packed,
                                            scapeDataType_t dtype, void* stream);
SCAPE_API scapeResult_t scapeMaskUnpackStream(scapeMask_t mask, const void* packed, void* dense,
                                              scapeDataType_t dtype, void* stream);

/*
 * Values-only collectives on the current mask (host or device memory). Wire traffic is proportional
 * to the mask's k, never to n; results are bit-identical on every rank. scapeAllReduce with a
 * non-NULL mask (count must equal the mask's n) is the dense-in / dense-out form: only masked
 * positions are packed, reduced and unpacked; the other elements of recvbuf are left untouched.
 * In-place (sendbuf == recvbuf) is allowed. The blocking form packs into a k-element buffer
 * the mask keeps between calls; scapeAllReduceAsync allocates one per request. Every form has
 * a non-blocking *Async variant completed with scapeTest / scapeWait, with the rules of the
 * dense *Async collectives (buffers untouched until completion; operations on a communicator
 * complete in issue order). Device buffers and `stream` as for the dense collectives: on a UCX
 * communicator the blocking forms enqueue on the stream and return (the packed values staged
 * as one collective: the bits of the host call); host buffers with a stream wait for it
 * first; the *Async forms take host buffers only (scapeUnsupported with device buffers); see
 * "GPU data path". Errors: scapeInvalidArgument (NULL mask, comm or buffer where k or this
 * rank's part is non-zero, a mask of another communicator, bad dtype/op, NULL request, host
 * and device buffers mixed); then as for the dense collectives.
 * The dense-in/out form's pack and unpack touch one cache line per masked position of a
 * buffer of n elements: at low density that costs several times the exchange (memory latency,
 * see perf/RESULTS.md), so a step that already produces packed values (the SCAPE step does:
 * the candidate kernel packs) should call the packed forms below.
 */

/** All-reduce of k packed values (mask order) in sendbuf into recvbuf (both k elements).
 *  Each owner's part is reduced in the same order as scapeMaskReduceScatter reduces it, so
 *  reduce-scatter + all-gather gives the same bits as this call (sharded and replicated
 *  optimizers stay identical). */
SCAPE_API scapeResult_t scapeMaskAllReducePacked(const void* sendbuf, void* recvbuf,
                                                 scapeDataType_t dtype, scapeRedOp_t op,
                                                 scapeMask_t mask, scapeComm_t comm, void* stream);
/** Non-blocking scapeMaskAllReducePacked; *request receives the handle (must not be NULL;
 *  complete it with scapeTest / scapeWait). k and the owner blocks are taken from the current
 *  mask when the call is made. */
SCAPE_API scapeResult_t scapeMaskAllReducePackedAsync(const void* sendbuf, void* recvbuf,
                                                      scapeDataType_t dtype, scapeRedOp_t op,
                                                      scapeMask_t mask, scapeComm_t comm,
                                                      void* stream, scapeRequest_t* request);
/** Reduce-scatter: sendbuf holds k packed values (mask order); rank r receives in recvbuf its
 *  part (k_r values, see scapeMaskGetRankCount) reduced over all ranks. */
SCAPE_API scapeResult_t scapeMaskReduceScatter(const void* sendbuf, void* recvbuf,
                                               scapeDataType_t dtype, scapeRedOp_t op,
                                               scapeMask_t mask, scapeComm_t comm, void* stream);
/** Non-blocking scapeMaskReduceScatter (request as for scapeMaskAllReducePackedAsync). */
SCAPE_API scapeResult_t scapeMaskReduceScatterAsync(const void* sendbuf, void* recvbuf,
                                                    scapeDataType_t dtype, scapeRedOp_t op,
                                                    scapeMask_t mask, scapeComm_t comm,
                                                    void* stream, scapeRequest_t* request);
/** All-gather: rank r contributes its part (k_r values); every rank receives all k values in
 *  mask order. */
SCAPE_API scapeResult_t scapeMaskAllGather(const void* sendbuf, void* recvbuf,
                                           scapeDataType_t dtype, scapeMask_t mask,
                                           scapeComm_t comm, void* stream);
/** Non-blocking scapeMaskAllGather (request as for scapeMaskAllReducePackedAsync). */
SCAPE_API scapeResult_t scapeMaskAllGatherAsync(const void* sendbuf, void* recvbuf,
                                                scapeDataType_t dtype, scapeMask_t mask,
                                                scapeComm_t comm, void* stream,
                                                scapeRequest_t* request);

/* ------------------------------------------------------------------------------------------ */
/* Generic sparse all-reduce (no agreed mask)                                                 */
/* ------------------------------------------------------------------------------------------ */

/** Algorithms for scapeSparseAllReduce. */
typedef enum {
  scapeSparseAuto = 0,              /**< recursive doubling with the dense switch */
  scapeSparseAllGather = 1,         /**< all-gather every list, reduce locally */
  scapeSparseRecursiveDoubling = 2, /**< pairwise merges; switches to dense once the union is
                                         dense enough (SparCML's rule) */
  scapeNumSparseAlgos = 3
} scapeSparseAlgo_t;

/**
 * Sparse all-reduce of (index, value) lists: every rank brings nnz sorted, distinct global
 * indices below n with their values; the result is the union, values reduced (sum or avg;
 * a missing index counts as 0), written densely to `denseOut` (n elements, every element
 * written) and/or as a list to `outIndices`/`outValues` (capacity entries; *outNnz receives
 * the union's size). A union larger than capacity is scapeInvalidArgument and writes no
 * output at all (the message gives the size needed). Every rank validates what it receives;
 * a malformed part from a peer (or ranks that disagree on n) fails the call on every rank
 * and puts the communicator in error state, as any failure after communication started.
 * Results are identical on every rank. dtype: fp32, fp16 or bf16 values.
 * Any buffer may be CUDA device memory (each is classified on its own): device inputs are
 * copied to the host and device outputs written back on the default stream, with host waits
 * (the union's size is known only at the end, so this call cannot be stream-ordered); finish
 * writing the inputs before the call. The result is the same as with host buffers.
 *
 * @param bytesSent  optional out: bytes this rank sent (to compare with dense and masked).
 */
SCAPE_API scapeResult_t scapeSparseAllReduce(const uint64_t* indices, const void* values,
                                             size_t nnz, uint64_t n, scapeDataType_t dtype,
                                             scapeRedOp_t op, scapeSparseAlgo_t algo,
                                             void* denseOut, uint64_t* outIndices, void* outValues,
                                             size_t capacity, size_t* outNnz, uint64_t* bytesSent,
                                             scapeComm_t comm);

/* ====================== BEGIN optimizer (SCAPE-AdamS step) ====================== */
/* ------------------------------------------------------------------------------------------ */
/* SCAPE-AdamS optimizer: the whole step as one call (issue 11)                                */
/* ------------------------------------------------------------------------------------------ */
/*
 * An optimizer object runs every phase of a SCAPE-AdamS step on host memory in one call,
 * on top of the agreed mask and the values-only collectives above:
 *
 *   1. waits for the mask sync started by the previous step and makes that mask current;
 *   2. candidate c = b1*m + (1-b1)*g + e (e: this rank's fp32 residual), fused with the pack
 *      of c at the current mask into the payload (fp32, bf16 or fp16) and with the residual
 *      update: e := c outside the mask; at the mask e := c - payload (the payload's rounding
 *      error: error feedback, 0 for fp32). An 8-bit payload (scapeFloat8E4M3 / E5M2) is packed
 *      as fp32, then every rank agrees the largest |value| over all ranks (one float's
 *      all-reduce) and converts at the shared power-of-two scale s = 2^e, the smallest that
 *      keeps nranks * max|c| / s within the format's largest finite value (e4m3 448, e5m2
 *      57344); e := c - s * payload at the mask, and the reduced values are read back times s;
 *   3. top-k of |c| on this rank's owned part selects the next mask (density of the next
 *      step, see the schedule), and its sync starts in the background;
 *   4. one values-only exchange of the payload: an all-reduce (average) with replicated state,
 *      a reduce-scatter with sharded state;
 *   5. recovered gradient g^ = (m_t - b1*m_{t-1}) / (1-b1) at the mask, global-norm clipping
 *      (one norm per step over every rank's part, sparse and always-dense segments together),
 *      AdamS update fused with the unpack: at the mask
 *        v = b2*m_{t-1}^2 + (1-b2)*g^^2,  m_t rebuilt from the clipped g^,
 *        theta = theta*(1 - lr*wd) - lr * m_t / (sqrt(v) + eps)   (bias correction: option),
 *      outside it theta = theta*(1 - lr*wd) and m = 0;
 *   6. sharded state only: each owner updates its part of the mask and the updated values
 *      (parameters and momentum, fp32) are all-gathered values-only.
 *
 * Always-dense segments (norms, biases) are always in the mask (see scapeMaskCreate): they
 * travel in the same values-only exchange as the sparse positions, as one dense block per
 * owner, and are counted apart in scapeOptimInfo_t.denseBytes.
 *
 * Step 0: scapeOptimCreate agrees on the full mask (every position), so the first step is a
 * dense step by construction, as the density warm-up (which starts at 1) wants.
 *
 * Results: parameters and momentum are bit-identical on every rank after every step, and the
 * sharded state gives the same bits as the replicated one (same mask ownership assumed: the
 * mask depends on how selection is partitioned). State per rank (scapeOptimInfo_t.stateBytes),
 * for n parameters and k positions in the mask of the last step:
 *   - the residual, fp32: 4n bytes. It is this rank's own error feedback by nature, so it is
 *     never sharded;
 *   - the momentum, fp32, packed: 4k bytes. It is +0 outside the mask of the last step and
 *     stored only there, in mask order. It is the same with scapeOptimReplicated and
 *     scapeOptimSharded: every rank's candidate pass reads it at every masked position, so it
 *     cannot be sharded (sharded ownership shards the statistic and the update instead);
 *   - with the fp32 master weights of scapeOptimStepMixed, 4n bytes more.
 * So 4 + 4d bytes per parameter at density d (4.4 at d = 0.1, 4.04 at d = 0.01; 8 at the
 * dense step 0 and while the warm-up density is 1), 8 + 4d with masters, on the host and in
 * device memory alike (scapeOptimStepStream; the device keeps the momentum's positions too, 8
 * bytes per masked value, counted in maskStateBytes). Besides: the mask's
 * index buffers (16 bytes per masked position, 8 more for a mask the momentum keeps after a
 * skipped step), and scratch for the statistic of the owned part, the payload and the
 * momentum at the new mask (scapeOptimInfo_t.scratchBytes).
 *
 * Threads and lifetime: an optimizer follows its communicator's rules (calls serialised with
 * the communicator's). It owns a mask on the communicator (scapeOptimGetMask): destroy the
 * optimizer before the communicator. scapeCommAbort frees its optimizers too (their handles
 * become invalid, like its masks'), also after device steps (a watchdog need not call
 * scapeOptimDestroy first): an optimizer's device state is freed once the stream has run its
 * last step (waited for within the communicator's timeout; leaked with a warning past it).
 */

/** Opaque optimizer handle. */
typedef struct scapeOptim* scapeOptim_t;

/** Where the optimizer state and the update live. */
typedef enum {
  /** Every rank updates every position (all-reduce of the payload). */
  scapeOptimReplicated = 0,
  /** ZeRO-1 style: each rank updates the masked positions it owns (reduce-scatter of the
   *  payload), then the updated parameters and momentum are all-gathered values-only. This
   *  divides the update's work, not the state: every rank still holds the whole momentum (the
   *  candidate of every position needs it), and the all-gather moves 8 bytes per masked value,
   *  so the sharded step sends more bytes than the replicated one. */
  scapeOptimSharded = 1,
  scapeNumOptimOwnerships = 2
} scapeOptimOwnership_t;

/** Bias correction of the AdamS update (t = the step's number, counting from 1). */
typedef enum {
  scapeBiasCorrectionNone = 0,     /**< the AdamS paper form: none (default) */
  scapeBiasCorrectionAdamS = 1,    /**< AdamS reference code: m_t and m_{t-1} / (1 - b1^t) */
  scapeBiasCorrectionArtifact = 2, /**< SCAPE artifact: m_t / (1 - b1^t), v / (1 - b2^t) */
  scapeNumBiasCorrections = 3
} scapeBiasCorrection_t;

/**
 * How the AdamS denominator of an entering coordinate is built (issue 23; docs/ALGORITHM.md
 * section 4.13). An entering coordinate is a masked position whose previous momentum is 0: it
 * was not in the previous step's mask (momentum is zeroed outside the mask), or its momentum
 * was exactly 0.
 */
typedef enum {
  /** The paper's form (default): v = (1 - b2) g^2 from the payload the coordinate carries, so
   *  it moves lr (1 - b1) / sqrt(1 - b2) whatever residual it carried. */
  scapeOptimEnteringPayload = 0,
  /** v = the mean of g^2 over the staying coordinates (previous momentum non-zero) of the same
   *  segment, from the reduced payload; the update is capped at 100 lr. A segment with no
   *  staying coordinate (step 0 included) uses the paper's form. No extra wire bytes in the
   *  replicated mode; the sharded mode adds 16 bytes per segment piece to the all-gather of
   *  the gradient-norm partials it already makes. */
  scapeOptimEnteringSegmentRms = 1,
  /** scapeOptimEnteringSegmentRms, plus Deep Gradient Compression's momentum factor masking
   *  adapted to AdamS (issue 30; docs/ALGORITHM.md 4.14): the entering update already moves
   *  the coordinate in proportion to the whole residual it delivered, so the momentum it keeps
   *  is clamped to one step's worth at its segment's scale, |m_t| <= (1 - b1) sqrt(v) with
   *  v = clip^2 * (the segment's mean square), so that the delivered mass does not push it
   *  again over the next steps. Coordinates that use the paper's form (no staying coordinate
   *  in the segment) keep their momentum. Same bytes as scapeOptimEnteringSegmentRms. */
  scapeOptimEnteringSegmentRmsMasked = 2,
  scapeNumOptimEnterings = 3
} scapeOptimEntering_t;

/**
 * What maxGradNorm clips (config.clipNorm; issue 30, docs/ALGORITHM.md section 4.7). The clip
 * factor is min(1, maxGradNorm / (norm + 1e-6)). Recovered and staying: it scales the whole
 * recovered gradient g^ and only the norm it is compared with changes; local: it scales this
 * rank's own gradient before the exchange.
 */
typedef enum {
  /** The L2 norm of g^ over every masked coordinate (default; what the paper and torch's
   *  clip_grad_norm_ over the averaged gradient do). */
  scapeOptimClipNormRecovered = 0,
  /** Over the staying coordinates only (masked, previous momentum non-zero): a coordinate that
   *  enters the mask carries the residual it accumulated over the steps it was left out, which
   *  can dominate the norm and make the clip scale down what the exchange just delivered. A
   *  step with no staying coordinate (step 0) does not clip. No extra wire bytes replicated;
   *  sharded, 16 bytes per segment piece ride on the norm partials' all-gather (as for
   *  scapeOptimEnteringSegmentRms, and shared with it). */
  scapeOptimClipNormStaying = 1,
  /** Each rank's own gradient, before error feedback (Deep Gradient Compression's local
   *  clipping): every rank takes the L2 norm of the gradient it passes (a joint step: of all
   *  its members' gradients) and weights that gradient by the factor as it enters the
   *  candidate and the residual, c = b1*m + ((1-b1)*factor)*g + e; g^ is not clipped after
   *  the exchange. The average of gradients of norm <= maxGradNorm has norm <= maxGradNorm.
   *  Ranks' factors differ; the exchanged sums, and so every update, are still the same bits
   *  on every rank. No wire bytes at all. scapeOptimInfo_t.gradNorm and clipScale then report
   *  this rank's norm and factor. In a joint step every member must use it or none. */
  scapeOptimClipNormLocal = 2,
  scapeNumOptimClipNorms = 3
} scapeOptimClipNorm_t;

/**
 * Optimizer configuration. Fill it with scapeOptimConfigInit (defaults below), then set the
 * layout and what differs. Every rank must pass the same configuration (checked: a layout
 * that differs between ranks fails scapeOptimCreate on every rank).
 *
 * | field          | meaning                                                    | default      |
 * |----------------|------------------------------------------------------------|--------------|
 * | n              | parameters in the flat buffer, 0 < n < 2^40                | 0 (must set) |
 * | nsegments      | segments (the model's tensors), >= 1                       | 0 (must set) |
 * | segOffsets     | nsegments + 1 offsets: 0, non-decreasing, last == n        | NULL (set)   |
 * | denseFlags     | NULL or nsegments bytes, non-zero = always dense           | NULL         |
 * | ownership      | a scapeOptimOwnership_t                                    | replicated   |
 * | maskOwnership  | a scapeOwnership_t (how selection is partitioned), or -1   | -1 (1)       |
 * | lr             | learning rate >= 0 (scapeOptimSetLr changes it)            | 1e-3         |
 * | beta1, beta2   | in [0, 1)                                                  | 0.9, 0.95    |
 * | eps            | >= 0, added outside the square root                        | 1e-8         |
 * | weightDecay    | decoupled, >= 0: theta *= 1 - lr*wd on every coordinate    | 0            |
 * | maxGradNorm    | clip to this L2 norm (g^, or each rank's g: clipNorm); 0 = none | 0       |
 * | biasCorrection | a scapeBiasCorrection_t                                    | none         |
 * | density        | target density rho* of sparse segments, 0 < rho* <= 1      | 0.01         |
 * | warmupSteps    | W >= 0: the density warm-up's length in steps (0: fixed)   | 0            |
 * | payloadType    | scapeFloat32, scapeBfloat16, scapeFloat16, scapeFloat8E4M3 | fp32         |
 * |                | or scapeFloat8E5M2 (8-bit: a shared scale, step 2 above)   |              |
 * | maskEncoding   | a scapeMaskEncoding_t                                      | auto         |
 * | entering       | a scapeOptimEntering_t (docs/ALGORITHM.md 4.13)            | payload      |
 * | clipNorm       | a scapeOptimClipNorm_t: what maxGradNorm is compared with  | recovered    |
 * | densitySchedule| a scapeDensitySchedule_t: the warm-up's shape (issue 42)   | geometric    |
 *
 * (1) -1: segments for replicated ownership, shards for sharded.
 *
 * The mask used at step t (counting from 0) was selected at step t-1 with density rho(t);
 * step 0 uses the full mask. Each segment piece keeps max(1, floor(rho*len)) positions.
 * The density schedule rho(t) (docs/ALGORITHM.md 4.10): rho(0) = 1; for 0 < t < W the
 * warm-up of densitySchedule (scapeDensitySchedule_t) from 1 to rho*; rho* from step W on.
 * W = 0 and W = 1 are the same schedule (step 0 is dense either way). The schedule is a
 * function of the step counter alone, computed on the host; the host and the device step
 * (scapeOptimStepStream) read the same value, checkpoints carry W and the shape, and
 * scapeOptimGetInfo reports rho of the last and the next step. scapeOptimScheduleForBudget
 * sizes W from an average density (a byte budget) over a planned number of steps.
 *
 * nonFinite: a scapeOptimNonFinite_t, what a step with an inf or NaN in some rank's gradients
 * does (default scapeOptimNonFiniteSkip: skipped on every rank, nothing changes).
 */
typedef struct {
  size_t size;    /**< sizeof(scapeOptimConfig_t); set by scapeOptimConfigInit */
  unsigned magic; /**< SCAPE_OPTIM_CONFIG_MAGIC; set by scapeOptimConfigInit */
  uint64_t n;
  int nsegments;
  const uint64_t* segOffsets; /**< copied at create */
  const uint8_t* denseFlags;  /**< copied at create */
  int ownership;              /**< scapeOptimOwnership_t */
  int maskOwnership;          /**< scapeOwnership_t or -1 */
  float lr;
  float beta1;
  float beta2;
  float eps;
  float weightDecay;
  float maxGradNorm;
  int biasCorrection; /**< scapeBiasCorrection_t */
  double density;
  int64_t warmupSteps;
  int payloadType;  /**< scapeDataType_t */
  int maskEncoding; /**< scapeMaskEncoding_t */
  int nonFinite;    /**< scapeOptimNonFinite_t: a step with non-finite gradients (default: skip) */
  int entering;     /**< scapeOptimEntering_t (default scapeOptimEnteringPayload) */
  int clipNorm;     /**< scapeOptimClipNorm_t (default scapeOptimClipNormRecovered) */
  int densitySchedule; /**< scapeDensitySchedule_t (default scapeDensityGeometric) */
} scapeOptimConfig_t;

/**
 * The shape of the density warm-up (config.densitySchedule; issue 42, docs/ALGORITHM.md
 * 4.10). rho* = config.density, W = config.warmupSteps; every shape has rho(0) = 1 and
 * rho(t) = rho* for t >= W, and differs only for 0 < t < W:
 */
typedef enum {
  /** rho(t) = rho*^(t/W): the authors' geometric ramp (default; the only shape before issue
   *  42, same bits). Half of the ramp's steps run below sqrt(rho*): at rho* = 0.01 the
   *  density is 0.1 at t = W/2. */
  scapeDensityGeometric = 0,
  /** rho(t) = 1 - (1 - rho*) t/W: linear in the step. Sends more than the geometric ramp of
   *  the same W (about (1 + rho*)/2 on average over the ramp against (1 - rho*)/ln(1/rho*)):
   *  at equal bytes its W is shorter (scapeOptimScheduleForBudget). */
  scapeDensityLinear = 1,
  scapeNumDensitySchedules = 2
} scapeDensitySchedule_t;

/**
 * The byte-budget form of the density schedule: the longest warm-up W (0 <= W <= totalSteps)
 * of shape `schedule` whose average density over the planned steps, (1/N) sum_{t<N} rho(t)
 * with N = totalSteps (step 0's 1 included), is at most `averageDensity`. The payload values
 * of sparse segments a run sends are about that average times their size times N (the mask
 * sync's bytes follow the same k; always-dense segments are outside the schedule), so a total
 * byte budget B for N steps of a model whose sparse segments hold n_s values at s bytes per
 * value is averageDensity = B / (N n_s s). The same W on every rank (a pure function). Put the
 * result in config.warmupSteps with config.densitySchedule = schedule.
 *
 * @param averageDensity  at least the fixed-density run's (1 + (N - 1) rho*)/N, at most 1
 *                        (1: W = N, a warm-up as long as the run).
 * @return scapeSuccess; scapeInvalidArgument (NULL warmupSteps, a schedule that is not a
 *         scapeDensitySchedule_t, density outside (0, 1], totalSteps < 1, averageDensity NaN,
 *         above 1 or below what a fixed density sends; the message gives that floor).
 *         Thread-safe; no communicator.
 */
SCAPE_API scapeResult_t scapeOptimScheduleForBudget(int schedule, double density,
                                                    double averageDensity, int64_t totalSteps,
                                                    int64_t* warmupSteps);

/**
 * What a step does when a rank's gradients hold an inf or NaN (config.nonFinite).
 *
 * Every step starts with an agreement (before anything of the state is written): each rank
 * scans its gradients for a non-finite value (one read of the n gradients) and the ranks
 * all-gather one 8-byte word each: that flag, and a fingerprint of the per-step
 * hyperparameters (lr, beta1, beta2, eps, weightDecay), which must be the same on every rank
 * (scapeInvalidUsage on every rank otherwise, nothing changed). If any rank's gradients are not
 * finite, every rank then:
 *  - scapeOptimNonFiniteSkip (default, what Megatron-LM and DeepSpeed do): skips the step.
 *    Nothing of the parameters or of the checkpointable state changes (momentum, residual,
 *    masks, the mask sync in flight, the step counter and with it the density schedule and the
 *    bias correction); the call returns scapeSuccess and scapeOptimInfo_t.skippedSteps counts
 *    it. The next step with finite gradients gives the bits of a run that never saw this one.
 *  - scapeOptimNonFiniteError: fails with scapeInvalidArgument naming the rank(s) (and, on such
 *    a rank, the first position and its value); nothing changes, nothing is counted.
 * The agreement is its own exchange: no exchange of the step comes before its first state
 * write (the candidate pass writes the residual), and undoing that write bit-exactly would need
 * a copy of the residual every step (docs/ALGORITHM.md gives the cost measured for both).
 *
 * Finite gradients can still give a non-finite payload: a candidate beyond the payload type's
 * range (fp16 holds |c| <= 65504) or an overflow of the average. Every rank sees it in the
 * reduced payload (the gradient norm is not finite, the same on every rank), and the step is
 * skipped (or fails, with Error) after the exchange: parameters, momentum, step counter and
 * schedule are unchanged, but the residual and the masks have moved on (the residual holds +0
 * where the payload was not finite). The device step computes that norm only with
 * maxGradNorm > 0; without clipping it does not see this case.
 *
 * Device buffers (scapeOptimStepStream): the scan runs on the device, on the stream, and the
 * call waits on the host for its one-word result before the agreement (a stream
 * synchronisation at the start of every device step: the step is enqueued after the work
 * queued before it has run). scapeOptimNonFiniteIgnore removes that wait.
 */
typedef enum {
  scapeOptimNonFiniteSkip = 0,
  scapeOptimNonFiniteError = 1,
  /** No check and no agreement: a non-finite gradient reaches the parameters (the behaviour
   *  before the check existed); saves the scan, the 8-byte all-gather and, on the device, the
   *  host wait for the flag. */
  scapeOptimNonFiniteIgnore = 2,
  scapeNumOptimNonFinite = 3
} scapeOptimNonFinite_t;

#define SCAPE_OPTIM_CONFIG_MAGIC 0x5CA90u

/** Fills *config with the defaults above (and its size and magic). scapeInvalidArgument on
 *  NULL. Thread-safe. */
SCAPE_API scapeResult_t scapeOptimConfigInit(scapeOptimConfig_t* config);

/**
 * Creates an optimizer on `comm`. Collective: every rank calls it with the same
 * configuration. Creates the optimizer's mask (scapeMaskCreate) and agrees on the full mask
 * for step 0. Momentum and residual start at 0.
 *
 * @return scapeSuccess; scapeInvalidArgument (NULL pointer, config not initialised with
 *         scapeOptimConfigInit, n or segments that do not tile [0, n), a hyperparameter that
 *         is negative, NaN or out of range, density outside (0, 1], unsupported payload
 *         type; the message names the field); scapeInvalidUsage (ranks disagree on the
 *         layout); communication errors as for any collective.
 */
SCAPE_API scapeResult_t scapeOptimCreate(scapeOptim_t* optim, const scapeOptimConfig_t* config,
                                         scapeComm_t comm);

/** Destroys an optimizer and its mask (waiting, within the timeout, for a sync in flight).
 *  NULL is a no-op.
 *
 *  Handles: every optimizer call looks its handle up first (as for communicators and masks).
 *  A destroyed optimizer (this call, or scapeCommAbort of its communicator), a second destroy,
 *  or a pointer that is not an optimizer handle is scapeInvalidArgument ("optim is not a live
 *  optimizer"; message in scapeGetLastError(NULL)) from every optimizer call, never a crash;
 *  the mask of a destroyed optimizer is dead as well (the mask calls refuse it). */
SCAPE_API scapeResult_t scapeOptimDestroy(scapeOptim_t optim);

/** Sets the learning rate of the following steps (>= 0, finite; every rank the same: checked
 *  at the next step, see scapeOptimSetHyperparams). */
SCAPE_API scapeResult_t scapeOptimSetLr(scapeOptim_t optim, float lr);

/**
 * @brief Sets the per-step hyperparameters between steps (what an LR / momentum scheduler
 * changes: torch's OneCycleLR cycles beta1, for example).
 *
 * scapeOptimSetHyperparams sets all five at once; scapeOptimSetBeta1, scapeOptimSetBeta2,
 * scapeOptimSetEps and scapeOptimSetWeightDecay set one and keep the others. The rules are
 * scapeOptimSetLr's and the configuration's: lr and eps finite and >= 0, 0 <= beta1 < 1,
 * 0 <= beta2 < 1, weightDecay finite and >= 0, and lr * weightDecay < 1 for the values in
 * force after the call (set lr and weightDecay together with scapeOptimSetHyperparams when
 * both change). Local calls: every rank must set the same values before its next step; the
 * step checks it in its non-finite agreement (a fingerprint of the five values travels with
 * the flag, scapeOptimNonFinite_t) and fails with scapeInvalidUsage on every rank, changing
 * nothing, when they differ (not checked with scapeOptimNonFiniteIgnore).
 * The values take effect from the next step on and are saved in checkpoints (scapeOptimLoad
 * restores the checkpoint's). What the step reads of them: beta1 in the candidate
 * (c = b1*m + (1-b1)*g + e) and in the gradient recovery of the same step, beta2, eps, lr and
 * weightDecay in the update; the next step uses the values in force when it is called.
 * Changing a value between steps changes nothing else (momentum, residual and masks stay).
 *
 * @return scapeSuccess; scapeInvalidArgument (not a live optimizer; a value out of range, the
 *         message names it: "beta1 = 1: expected 0 <= beta1 < 1"; nothing was changed).
 */
SCAPE_API scapeResult_t scapeOptimSetHyperparams(scapeOptim_t optim, float lr, float beta1,
                                                 float beta2, float eps, float weightDecay);
SCAPE_API scapeResult_t scapeOptimSetBeta1(scapeOptim_t optim, float beta1);
SCAPE_API scapeResult_t scapeOptimSetBeta2(scapeOptim_t optim, float beta2);
SCAPE_API scapeResult_t scapeOptimSetEps(scapeOptim_t optim, float eps);
SCAPE_API scapeResult_t scapeOptimSetWeightDecay(scapeOptim_t optim, float weightDecay);

/**
 * One SCAPE-AdamS step (all phases above). Collective: every rank calls it, in the same order
 * as its other collectives on the communicator.
 *
 * @param params  n fp32 parameters, updated in place; identical on every rank before the
 *                first step (they stay so). 4-byte aligned, not overlapping grads.
 * @param grads   n fp32 gradients of this rank (read only). 4-byte aligned.
 * @param count   must equal the layout's n.
 * Device pointers (both params and grads; a mix is scapeInvalidArgument): the call is
 * scapeOptimStepStream with stream = NULL (the default stream); it enqueues and returns.
 * After device steps, a step on host buffers first waits for the device work and moves the
 * optimizer state back to the host.
 * @return scapeSuccess; scapeInvalidArgument (NULL or misaligned buffer, overlapping buffers,
 *         count != n; nothing was changed); scapeInvalidUsage (a sync of the optimizer's mask
 *         started by another user of the mask is in flight, or that user advanced the mask;
 *         nothing was changed); communication errors as for any collective.
 */
SCAPE_API scapeResult_t scapeOptimStep(scapeOptim_t optim, float* params, const float* grads,
                                       uint64_t count);

/**
 * @brief The optimizer step on CUDA device buffers, enqueued on a stream (GPU data path).
 *
 * params and grads are n floats of device (or managed) memory; the step is enqueued on
 * `stream` (a cudaStream_t; NULL: the default stream) and the call returns; the work is
 * ordered on the stream after what the caller queued there. The optimizer's state (momentum,
 * residual) moves to device memory at the first device step (the host state is copied there).
 * Mixing is allowed: a later scapeOptimStep on host buffers waits for the device work and
 * moves the state back to the host (a host wait).
 *
 * Host waits, where unavoidable:
 *  - the next mask's positions (this rank's top-k, a few positions) are copied to the host
 *    and its mask sync is started from the host: at the end of the call when the copy has
 *    already completed, else at the next optimizer call (step, checkpoint, destroy), which
 *    waits for that copy;
 *  - with maxGradNorm > 0 the call waits for the gradient norm (the clip scale is an argument
 *    of the update), so the update is enqueued after that wait; without clipping,
 *    scapeOptimInfo_t.gradNorm is 0 after a device step (not computed);
 *  - with entering = scapeOptimEnteringSegmentRms the call waits for the per-segment staying
 *    sums (a few bytes per segment; the segment values are an argument of the update);
 *  - a step on another stream than the last device step first waits for that stream;
 *  - the non-finite check (scapeOptimNonFinite_t, default Skip): the scan of the gradients
 *    runs on the stream and the call waits for its one-word result (a stream synchronisation
 *    at the start of the call, so the step is enqueued after the work queued before it has
 *    run); scapeOptimNonFiniteIgnore removes this wait.
 * The caller must not change params or grads until the stream has run the step, and must
 * keep the stream of the last device step alive until the optimizer is destroyed (destroy
 * waits for it, within the communicator's timeout; past it the device state is leaked with a
 * warning rather than freed under the stream). Each of these host waits (and the wait for the
 * selected positions) has the communicator's timeout: a stream that does not get there in
 * time (work queued ahead of the step that never finishes) fails the call with scapeTimeout
 * naming the wait, instead of blocking the caller (or a watchdog's scapeCommAbort).
 *
 * Bits: the same params, state and masks as scapeOptimStep on the same inputs, for every
 * payload type (a bf16/fp16/fp8 payload's rounding error goes back into the residual inside
 * the mask, as in the host step; an 8-bit payload's scale is agreed on the device, with no host
 * wait). Sharded ownership runs the host step's algorithm: the owner
 * of each masked value updates it into a (param, momentum) pair and the pairs are all-gathered
 * on the stream (scapeOptimInfo_t counts the same bytes as for a host step).
 *
 * Device memory: the state (the residual, 4 bytes per parameter, and the momentum packed at
 * the mask with its positions, 12 bytes per masked value; +4 per parameter with master
 * weights), the statistic (4 bytes per parameter; between steps and during the step it also
 * holds the momentum densely, so the packing costs no pass over n) and, sized by the mask rather
 * than by n, the payload buffers (3 per masked value, of the payload type), the momentum at the
 * mask (4 bytes per masked value), the mask positions (8 bytes per masked value; 32 when the
 * mask's order differs from position order), the sharded pairs (16 bytes per masked value)
 * and the top-k output, all from the communicator's device pool. Those buffers are refitted when
 * the mask outgrows them or falls below a quarter of them (step 0's mask is full; the density
 * warm-up shrinks it step by step): the old ones are freed once the stream has passed the
 * refit, with no host wait, and a step at a settled density allocates nothing.
 * scapeOptimInfo_t counts them (stateBytes, maskStateBytes, scratchBytes).
 *
 * scapeOptimStep with device buffers behaves as this call with stream = NULL.
 * Backends: on a UCX communicator the packed exchange is staged through page-locked host
 * memory (or zero-copy); on an NCCL-backend communicator (scapeCommInitNccl, with its host
 * communicator) it is NCCL's (ncclAllReduce with ncclAvg, or the grouped ncclReduce /
 * ncclBroadcast of the sharded form) on `stream`, and the mask sync runs on the host
 * communicator. NCCL's floating-point sums need not match the UCX backend's bits: the step
 * gives every rank the same bits, and with 1 or 2 ranks the host step's bits (a sum of two
 * values does not depend on its order).
 *
 * @return scapeSuccess; scapeInvalidArgument (as scapeOptimStep; params and grads of different
 *         kinds (host / device); a non-NULL stream with host buffers); errors of earlier device
 *         work on the stream.
 */
SCAPE_API scapeResult_t scapeOptimStepStream(scapeOptim_t optim, float* params, const float* grads,
                                             uint64_t count, void* stream);

/**
 * @brief Mixed precision: the optimizer step with 16-bit params and fp32 master weights (the
 * layout of Megatron-LM's mixed-precision optimizer and DeepSpeed's bf16 optimizer).
 *
 * params: n elements of paramType, updated in place. paramType scapeBfloat16 or scapeFloat16:
 * the optimizer holds fp32 master weights (the AdamS update runs on them) and the update
 * writes the master and params in the same pass: after every step, params[i] is the master
 * rounded to nearest even, at every position (also outside the mask and with weightDecay 0).
 * The masters are initialised from params (widened exactly) at the first mixed step; params
 * must be identical on every rank then (as for scapeOptimStep), so the masters are too. Between
 * steps the masters are the parameters' truth: a change the caller makes to params is
 * overwritten by the next step. paramType scapeFloat32: no masters, the same as
 * scapeOptimStep / scapeOptimStepStream.
 * grads: n elements of gradType (scapeFloat32, scapeBfloat16 or scapeFloat16), read only;
 * widened exactly to fp32 (host: one pass into fp32 scratch, 4 bytes per parameter; device: in
 * the candidate kernel).
 * Host or device memory (both the same kind): device buffers behave as scapeOptimStepStream
 * (enqueued on `stream`, NULL = default stream; the same host waits), plus, at the first mixed
 * step only, one host wait: params are copied to the host to initialise the masters, which
 * then move to the device with the rest of the state. Host buffers need stream = NULL.
 *
 * State: the masters add 4 bytes per parameter (12 in all with momentum and residual; see
 * scapeOptimInfo_t.stateBytes); they are in the checkpoint (format version 2; version-1
 * checkpoints, which have none, still load, and the next mixed step initialises the masters
 * from its params), so resuming is bit-identical. Once an optimizer holds masters (after a
 * mixed step or a loaded checkpoint with masters), the param type is fixed and
 * scapeOptimStep / scapeOptimStepStream fail with scapeInvalidUsage.
 * Bits: every rank ends with the same masters and params; host and device steps agree.
 *
 * @return scapeSuccess; scapeInvalidArgument (as scapeOptimStep, and: paramType or gradType
 *         not scapeFloat32 / scapeBfloat16 / scapeFloat16, a buffer not aligned to its element
 *         size, paramType different from the type the masters were made for, a non-NULL
 *         stream with host buffers; the message names the argument).
 */
SCAPE_API scapeResult_t scapeOptimStepMixed(scapeOptim_t optim, void* params,
                                            scapeDataType_t paramType, const void* grads,
                                            scapeDataType_t gradType, uint64_t count, void* stream);

/** One member of a joint step (scapeOptimStepJoint): an optimizer and its buffers, as for
 *  scapeOptimStepMixed (paramType and gradType scapeFloat32: the plain step). */
typedef struct {
  scapeOptim_t optim;
  void* params;
  scapeDataType_t paramType;
  const void* grads;
  scapeDataType_t gradType;
  uint64_t count; /**< the optimizer's n */
} scapeOptimStepArgs_t;

/**
 * One step of several optimizers as one optimizer step: a framework's parameter groups, each
 * its own scapeOptim_t (its own learning rate, weight decay, layout), clipped by one global
 * norm, as torch.nn.utils.clip_grad_norm_ over every group, Megatron-LM and DeepSpeed do.
 * Collective: every rank calls it with the same optimizers in the same order (each created on
 * `comm`, the same communicator for all).
 *
 * Each member's step runs up to its gradient norm (the mask wait, candidate, the next mask's
 * selection, the values-only exchange, the squared L2 norm of its recovered gradient g^); then
 * the norm over all members, sqrt of their squared norms added in member order (the same bits
 * on every rank), is the one every member's clipping compares with maxGradNorm; then each
 * member's update. scapeOptimInfo_t.gradNorm of every member is that joint norm, clipScale the
 * joint factor. Each member moves the same bytes as its own step would.
 * Non-finite values (scapeOptimNonFinite_t): every member's agreement runs first; when some
 * rank's gradients of any member hold an inf or NaN, every member skips the step before
 * anything of theirs changed (counted in each skippedSteps), and with scapeOptimNonFiniteError
 * the call fails with that member's error and nothing changes. A reduced payload that is not
 * finite although every gradient was makes every member skip after its exchange (as the single
 * step does: residuals and masks moved on).
 * Requirements: every member's maxGradNorm and nonFinite are the same (maxGradNorm is the one
 * threshold of the joint norm); no optimizer appears twice; every member's buffers are host
 * memory, or every member's device memory on `stream` (NULL = default stream; NULL for host
 * buffers). Each member's buffers are checked as scapeOptimStepMixed checks them. count = 1 is
 * the member's own step.
 *
 * @return scapeSuccess; scapeInvalidArgument (steps NULL, count < 1, a member's arguments as
 *         scapeOptimStepMixed, two members on different communicators or the same optimizer
 *         twice, different maxGradNorm or nonFinite, host and device members mixed; the
 *         message names the member), or a member's step error (the message names the member).
 */
SCAPE_API scapeResult_t scapeOptimStepJoint(const scapeOptimStepArgs_t* steps, int count,
                                            void* stream);

/** The phases of a step, as timed in scapeOptimInfo_t.phaseSeconds. */
typedef enum {
  scapeOptimPhaseSyncWait = 0,  /**< the non-finite check and agreement (scapeOptimNonFinite_t),
                                     waiting for the mask sync of the previous step, advance */
  scapeOptimPhaseCandidate = 1, /**< candidate + pack + residual (one fused pass) */
  scapeOptimPhaseSelect = 2,    /**< top-k of the owned part, start of the mask sync */
  scapeOptimPhaseExchange = 3,  /**< the values-only all-reduce (or reduce-scatter) */
  scapeOptimPhaseNorm = 4,      /**< recovered-gradient norm (and its all-gather if sharded) */
  scapeOptimPhaseUpdate = 5,    /**< AdamS update fused with the unpack */
  scapeOptimPhaseGather = 6,    /**< sharded: all-gather of the updated values and unpack */
  scapeOptimNumPhases = 7
} scapeOptimPhase_t;

/**
 * What the optimizer is doing; see scapeOptimGetInfo. Versioned through `size`: initialise it
 * with SCAPE_OPTIM_INFO_INITIALIZER (or set size = sizeof(scapeOptimInfo_t) and magic =
 * SCAPE_OPTIM_INFO_MAGIC) before each scapeOptimGetInfo. The library fills the first
 * min(size, its own sizeof) bytes and sets size to that count, so a caller built against an
 * older header (a smaller struct: fewer appended fields) gets the fields it knows and nothing
 * past its struct is written, and a caller built against a newer header than the library can
 * tell from size which fields were filled (the rest keep what the caller put there). A struct
 * whose magic is not SCAPE_OPTIM_INFO_MAGIC (never initialised, or built against a header
 * from before the size field) or whose size is smaller than the size and magic fields
 * themselves is scapeInvalidArgument, with nothing written.
 */
typedef struct {
  size_t size;         /**< in: sizeof(scapeOptimInfo_t) of the caller's header; out: the
                            bytes the library filled. Set by SCAPE_OPTIM_INFO_INITIALIZER */
  unsigned magic;      /**< SCAPE_OPTIM_INFO_MAGIC; set by SCAPE_OPTIM_INFO_INITIALIZER */
  int64_t step;        /**< steps completed */
  double density;      /**< scheduled density of the mask the last step used (1 before
                            the first step) */
  double nextDensity;  /**< scheduled density of the mask the next step uses */
  uint64_t maskCount;  /**< k of the mask the last step used, all ranks' parts (n before
                            the first step) */
  uint64_t denseCount; /**< positions of always-dense segments (always in the mask) */
  /* Bytes this rank sent in the last step, by category (ring volumes of the collectives:
   * all-reduce 2(P-1)/P, reduce-scatter and all-gather (P-1)/P of the values each moves).
   * maskBytes + payloadBytes + denseBytes + controlBytes is everything the step sent. */
  uint64_t maskBytes;      /**< encoded part of the last completed mask sync */
  uint64_t payloadBytes;   /**< values of sparse positions (the payload exchange and, sharded,
                                the all-gather of the updated (param, momentum) pairs) */
  uint64_t denseBytes;     /**< values of always-dense positions */
  double gradNorm;         /**< global L2 norm of g^ in the last step (before clipping); with
                                clipNorm = local this rank's own gradient's norm */
  float clipScale;         /**< factor applied to g^ in the last step (1: no clipping); with
                                clipNorm = local the factor this rank's gradient had */
  uint64_t stateBytes;     /**< residual (4 bytes per parameter) + momentum (4 bytes per
                                position of the mask of the last step: packed, on the host and
                                on the device), + fp32 master weights with 16-bit params
                                (4 bytes per parameter); see scapeOptimCreate */
  uint64_t maskStateBytes; /**< the mask's index buffers (and a mask the momentum keeps
                                after a skipped step; after a device step, + the device's:
                                8 or 32 bytes per masked value, + 8 per momentum value) */
  uint64_t scratchBytes;   /**< payload, statistic and exchange buffers (and the fp32
                                copy of 16-bit grads of scapeOptimStepMixed on the host);
                                after a device step, + the device's: the statistic (4 bytes
                                per parameter) and the payload, pair and top-k buffers (sized
                                by the mask, see scapeOptimStepStream) */
  double phaseSeconds[scapeOptimNumPhases]; /**< wall time of each phase in the last step */
  /* Appended fields (the order above is the ABI's). */
  uint64_t controlBytes;  /**< the step's small control exchanges: the all-gather of the
                               non-finite agreement (8 bytes per rank: 8(P-1) bytes), and in the
                               sharded host step the all-gather of the per-owner norm partials
                               (one double per rank: 8(P-1) bytes more) */
  int64_t skippedSteps;   /**< steps skipped for non-finite gradients since the optimizer was
                               made (scapeOptimNonFinite_t; not in checkpoints, kept by
                               scapeOptimLoad). A skipped step leaves the other fields as the
                               last completed step set them, except gradNorm (NaN), clipScale
                               (1), the phase times and the byte counters (what it sent) */
  double maskWaitSeconds; /**< of phaseSeconds[scapeOptimPhaseSyncWait], the time the last step
                               blocked on the previous step's mask sync (0 when it had already
                               completed in the background, and at the first step): the part
                               of the sync that the work between the steps did not hide. The
                               rest of that phase is the non-finite check and agreement and
                               the advance to the new mask */
} scapeOptimInfo_t;

#define SCAPE_OPTIM_INFO_MAGIC 0x5CA91u
/** Initialiser of scapeOptimInfo_t: `scapeOptimInfo_t info = SCAPE_OPTIM_INFO_INITIALIZER;`
 *  (the other fields zero). */
#define SCAPE_OPTIM_INFO_INITIALIZER \
  { sizeof(scapeOptimInfo_t), SCAPE_OPTIM_INFO_MAGIC }

/** Fills *info (see scapeOptimInfo_t for `size` and `magic`, which must be set). Local.
 *  scapeInvalidArgument: info NULL, magic not SCAPE_OPTIM_INFO_MAGIC, or size too small. */
SCAPE_API scapeResult_t scapeOptimGetInfo(scapeOptim_t optim, scapeOptimInfo_t* info);

/** The optimizer's mask, for the mask queries (scapeMaskGetCount, scapeMaskGetIndices, ...).
 *  Owned by the optimizer (do not destroy it); starting its sync or advancing it yourself
 *  makes the next scapeOptimStep fail with scapeInvalidUsage. */
SCAPE_API scapeResult_t scapeOptimGetMask(scapeOptim_t optim, scapeMask_t* mask);

/**
 * Checkpoints. A checkpoint holds this rank's whole optimizer state: momentum, residual, the fp32
 * master weights if the optimizer holds them (scapeOptimStepMixed), this
 * rank's parts of the current and the next mask, the step counter (the schedule position),
 * the hyperparameters and a fingerprint of the layout and of the rank count; it is versioned
 * and checksummed (format version 4, with the momentum packed at the mask; versions 1 to 3,
 * whose momentum is dense, still load). Parameters are not included (save
 * them as usual), but the fp32 master weights of scapeOptimStepMixed are. Each rank saves and
 * loads its own checkpoint.
 *
 * scapeOptimCheckpointSize writes the bytes scapeOptimSave needs to *bytes. Both wait for the
 * mask sync in flight (local), and for the device work of a device optimizer (the momentum's
 * size is known on the host only). scapeOptimSave writes the checkpoint into buf (capacity bytes;
 * scapeInvalidArgument if too small) and its size to *written.
 *
 * scapeOptimLoad restores a checkpoint: collective (every rank loads, its own checkpoint).
 * Every rank validates its buffer first (size, magic, version, checksum, layout, rank count,
 * rank) and the ranks agree on the outcome before anything changes: if any rank's checkpoint
 * is bad, every rank fails (the bad rank with scapeInvalidArgument naming what is wrong, the
 * others with scapeInvalidUsage naming that rank) and every optimizer is left untouched. On
 * success the hyperparameters are the checkpoint's and the run continues bit-identical to one
 * that was never interrupted. A checkpoint from another rank count is refused (no
 * re-sharding).
 *
 * State on the device (after scapeOptimStepStream): scapeOptimCheckpointSize waits for the
 * last step's next-mask selection; scapeOptimSave waits for the device work of the last step
 * (a host wait on its stream) and copies the device state into the checkpoint;
 * scapeOptimLoad waits likewise and restores the state to the device. Checkpoints are the
 * same bytes either way: one saved with device state loads into a host optimizer and the
 * reverse.
 */
SCAPE_API scapeResult_t scapeOptimCheckpointSize(scapeOptim_t optim, size_t* bytes);
SCAPE_API scapeResult_t scapeOptimSave(scapeOptim_t optim, void* buf, size_t capacity,
                                       size_t* written);
SCAPE_API scapeResult_t scapeOptimLoad(scapeOptim_t optim, const void* buf, size_t size);
/* ======================= END optimizer (SCAPE-AdamS step) ======================= */

/* ====================== BEGIN device (GPU data path, issue 13) ====================== */
/* ------------------------------------------------------------------------------------------ */
/* GPU data path: device buffers on CUDA streams, and the NCCL backend                        */
/* ------------------------------------------------------------------------------------------ */
/*
 * The library finds out where each buffer lives (cudaPointerGetAttributes). Without a CUDA
 * driver, or in a build without CUDA (scapeGetDeviceSupport), every pointer is host memory.
 * A collective's buffers must both be host memory or both device memory (managed memory
 * counts as device memory); a mix is scapeInvalidArgument naming the arguments. Every rank
 * must pass the same kind of buffers to a given collective.
 *
 * Device buffers on a UCX communicator (scapeCommInit*): scapeAllReduce, scapeReduceScatter,
 * scapeAllGather and scapeBroadcast enqueue on `stream` (NULL: the default stream) and return
 * at once, as NCCL's calls do: the buffers are read and written in stream order, so work
 * queued on the stream after the call sees the result. The bytes are staged through
 * page-locked host buffers (Debian's UCX moves no CUDA memory): copies to the host, the host
 * collective, copies back, in chunks of SCAPE_DEVICE_CHUNK_BYTES (default 4 MiB; at most 16
 * chunks per call, larger chunks beyond that, so that a call adds a bounded number of entries
 * to the stream's queue), so that the copies of one chunk overlap the wire of the next.
 * Zero copy: when every rank's UCX moves CUDA memory (agreed at the first device collective)
 * and SCAPE_DEVICE_ZERO_COPY is 1 (the default), all-gathers and broadcasts hand the device
 * buffers to UCX directly, in stream order, without staging; reductions are always staged. The host
 * collective runs on a background thread of the communicator, over a second, private UCX channel
 * that the first device collective creates (collectively, so every rank must make its first device
 * collective at the same call: a one-time host wait). Results are the same bits on every rank. Each
 * chunk is reduced as a collective of its own: integer results, max/min and 2-rank results equal a
 * host collective on the whole buffer bit for bit; floating-point sums over 3 or more ranks
 * may differ from it in the last bits (another order of the additions). A chunk size at
 * least the buffer's size gives the whole-buffer host collective's exact bits.
 * Rules of this path:
 *  - The stream is blocked (a device-side wait on a host flag: one spinning thread per chunk)
 *    while its chunk is on the wire: other work on that stream waits, work on other streams
 *    does not, as long as the device runs them concurrently: with
 *    CUDA_DEVICE_MAX_CONNECTIONS=1 all streams share one hardware queue, and work of another
 *    stream queued behind the wait waits for it too (a deadlock if the exchange needs that
 *    work; keep the default connections with the UCX backend's device collectives).
 *  - Not in a CUDA graph: a staged device collective issued while its stream captures is
 *    scapeUnsupported (its stream waits on a flag that the library sets when the exchange
 *    runs; a graph replay would wait on one nobody sets). Use the NCCL backend in graphs.
 *  - Issue device collectives in an order the streams can satisfy: if stream A's collective
 *    is issued first, A must not wait for a later collective on stream B (as with NCCL).
 *  - Errors found after the call returned (a peer that fails, a timeout) leave the receive
 *    buffer unchanged, are returned by the next device collective on the communicator and by
 *    scapeCommGetAsyncError.
 *  - scapeCommDestroy waits (host wait, within the timeout) for device collectives in flight
 *    to reach the end of their streams.
 *  - Masks: the packed collectives (scapeMaskAllReducePacked, scapeMaskReduceScatter,
 *    scapeMaskAllGather) enqueue on `stream` and return; the packed values are staged whole
 *    as one V collective (not chunked), so the bits equal the same call on host buffers.
 *    scapeAllReduce with a mask enqueues, on `stream`: a device gather of the mask's positions
 *    of sendbuf into a device temporary, the staged all-reduce of the packed values, a device
 *    scatter into recvbuf; recvbuf's positions outside the mask keep their values, in place or
 *    not, as on the host (same bits). The mask's current positions are uploaded to the device
 *    once per mask generation and stream, and reused by later calls of that generation on that
 *    stream. Every device temporary of the mask calls (positions, packed values, the device
 *    top-k's output), on both backends, comes from one pool per communicator: a block goes
 *    back to it once the work that uses it is enqueued, is reused at once on the same stream
 *    and on other streams once that work has completed; at most 8 idle blocks are kept, and
 *    the pool is freed with the communicator (waiting, within the timeout, for work in
 *    flight), or, when scapeCommAbort frees an optimizer that stepped on the device with it,
 *    once that optimizer's state has handed its blocks back. So a training loop's steady
 *    state makes no cudaMalloc / cudaFree (which may synchronise the device); memory is
 *    allocated only when k outgrows what the pool holds.
 *    A mask advanced after a call does not affect that call.
 *    If the exchange fails after the call returned, recvbuf's positions outside the mask keep
 *    their values but its masked positions may have been overwritten (the scatter runs on
 *    the stream regardless); the error is reported as for the other device collectives.
 *  - scapeMaskPack / scapeMaskUnpack take no stream: with device buffers they run on the
 *    default (legacy) stream, enqueued, and return; scapeMaskPackStream /
 *    scapeMaskUnpackStream (and scapeMaskSelectNextTopkStream) enqueue on a given stream.
 *  - scapeMaskSelectNextTopk with a device statistic runs the top-k on the device, on the
 *    default stream, over the segments this rank owns (the same selection as from host
 *    memory) and copies back only the selected positions: a host wait for that copy (bounded
 *    by the communicator's timeout). The caller must have finished writing the statistic.
 *  - scapeSparseAllReduce takes device buffers through host copies (host waits; see it).
 *  - The optimizer step takes device params and grads: scapeOptimStepStream (and
 *    scapeOptimStep on the default stream), on both backends, fp32, bf16 or fp16 payloads;
 *    its host waits are listed at scapeOptimStepStream.
 *  - Not available with device buffers in this release (scapeUnsupported): the *Async forms
 *    (the blocking forms are already asynchronous).
 *
 * The NCCL backend (scapeCommInitNccl) runs the same calls on a caller's ncclComm_t, with
 * ncclAllReduce, ncclReduceScatter, ncclAllGather and ncclBroadcast on the caller's stream
 * (NCCL picks NVLink, its network or our net plugin). NCCL is loaded at run time
 * (SCAPE_NCCL_LIBRARY, else libnccl.so.2): the library has no link-time dependency on CUDA
 * or NCCL. Reductions are NCCL's (floating-point sums need not match the UCX backend's bits).
 * What runs where on an NCCL-backend communicator:
 *  - Device buffers: NCCL, on the caller's stream (enqueued; the call returns at once).
 *    The packed (values-only) collectives of a mask, whose per-rank blocks differ: all-reduce
 *    = one ncclAllReduce of the k values; reduce-scatter = one ncclReduce per rank's block
 *    (root = that rank) and all-gather = one ncclBroadcast per block (root = its owner), each
 *    inside ncclGroupStart / ncclGroupEnd, or NCCL's own ncclReduceScatter / ncclAllGather
 *    when every block has the same size. scapeAllReduce with a mask on device buffers
 *    gathers the mask's positions into a device buffer, all-reduces it with ncclAllReduce and
 *    scatters it back, all on the caller's stream (positions outside the mask keep recvbuf's
 *    values, as on the host); the positions are uploaded once per mask generation.
 *  - Host work: the host communicator that scapeCommInitNccl joins (SCAPE_NCCL_HOST_COMM=1,
 *    the default): masks (their sync all-gathers host memory on the mask's background
 *    thread), the optimizer's host-buffer steps and its masks (its device steps exchange
 *    over NCCL, above), scapeBarrier, and collectives on host buffers (which first wait
 *    for a non-NULL stream, as on a UCX communicator). With SCAPE_NCCL_HOST_COMM=0 there is
 *    none: those calls fail (scapeInvalidUsage naming the knob; host buffers:
 *    scapeInvalidArgument), and so does scapeBarrier (scapeUnsupported).
 *  - No *Async forms with device buffers (as on the UCX backend).
 */

/** The backend that moves a communicator's bytes. */
typedef enum {
  scapeBackendUcx = 0,  /**< scapeCommInit*: UCX (host buffers; device buffers staged) */
  scapeBackendNccl = 1, /**< scapeCommInitNccl (a caller's NCCL communicator) and
                             scapeCommInitNcclRank / scapeCommInitNcclFromEnv (the library's) */
  scapeNumBackends = 2
} scapeBackend_t;

/**
 * Makes a communicator on a caller's NCCL communicator (an ncclComm_t passed as void*, so this
 * header needs no NCCL header). The NCCL communicator stays the caller's: destroy the SCAPE
 * communicator first, then the NCCL one. Rank and size are NCCL's (scapeCommUserRank /
 * scapeCommCount).
 *
 * With SCAPE_NCCL_HOST_COMM=1 (the default) it also makes a host (UCX) communicator of the
 * same ranks, for masks, the optimizer, barriers and host buffers: rank 0 makes a bootstrap id
 * (as scapeGetUniqueId does), broadcasts it to every rank with ncclBroadcast over the NCCL
 * communicator (through a small device buffer, on a stream the call creates), and every rank
 * joins the UCX communicator with it (as scapeCommInitRank does). That makes the call
 * collective: every rank of the NCCL communicator must call it, and each waits on the host
 * for the broadcast (within the timeout: scapeTimeout, never a hang, if a rank does not come)
 * and for the others to connect. It issues NCCL work, so call it when the NCCL communicator
 * is not in use by another thread. scapeCommDestroy and scapeCommAbort tear down both (the
 * NCCL communicator itself is left alone). With SCAPE_NCCL_HOST_COMM=0 the call is local
 * (no communication) and the communicator runs dense device collectives only.
 *
 * @param comm      out: the new communicator.
 * @param ncclComm  the ncclComm_t.
 * @param config    NULL or a configuration (validated; timeoutMs applies, and the host
 *                  communicator takes the rest).
 * @return scapeSuccess; scapeInvalidArgument (NULL comm or ncclComm, a bad config);
 *         scapeUnsupported (NCCL cannot be loaded: the message names the library and why;
 *         or no device runtime for the id broadcast); scapeSystemError (the library is not
 *         NCCL >= 2.10: the message names the missing entry point or the version); NCCL's
 *         errors; scapeTimeout and the bootstrap's errors of the host communicator (the
 *         message names it and SCAPE_NCCL_HOST_COMM).
 */
SCAPE_API scapeResult_t scapeCommInitNccl(scapeComm_t* comm, void* ncclComm,
                                          const scapeConfig_t* config);

/**
 * Makes an NCCL-backend communicator whose NCCL communicator the library creates and owns, for
 * callers that have no ncclComm_t (PyTorch does not hand out its own). Collective, with the
 * same arguments as scapeCommInitRankConfig: every rank first joins the host (UCX)
 * communicator with `uniqueId` exactly as scapeCommInitRankConfig does; then rank 0 gets an
 * ncclUniqueId from NCCL (ncclGetUniqueId), broadcasts it to every rank over the host
 * communicator (host memory: no device buffer, no stream), and every rank calls
 * ncclCommInitRank(nranks, id, rank) on the calling thread's current CUDA device (set it
 * first, e.g. cudaSetDevice(local_rank)). The ranks then agree on the outcome (a host
 * all-reduce), so either every rank gets its communicator or every rank gets an error.
 *
 * NCCL is loaded at run time: SCAPE_NCCL_LIBRARY (a name or a path, e.g. the libnccl.so.2 that
 * PyTorch's wheel brings in site-packages/nvidia/nccl/lib; the Python package sets it to that
 * one when the variable is unset), else "libnccl.so.2" through the dynamic loader (a library of
 * that name already loaded in the process, such as PyTorch's, is the one used). It must have
 * ncclGetUniqueId, ncclCommInitRank and ncclCommDestroy; it is loaded before the host
 * communicator is joined, so a missing library fails on every rank at once.
 *
 * The communicator behaves as one made by scapeCommInitNccl with SCAPE_NCCL_HOST_COMM=1 (the
 * knob is not read: the host communicator always exists), rank and size are the host
 * communicator's (and NCCL's: they are equal), and it OWNS the NCCL communicator:
 * scapeCommDestroy ends it with ncclCommDestroy (after the device work of the SCAPE
 * communicator has drained; waited for at most the timeout, then left behind with a warning),
 * scapeCommAbort with ncclCommAbort (ncclCommDestroy if the library has no ncclCommAbort).
 * Once scapeCommAbort has begun (a watchdog thread aborting while a call is in progress), the
 * library makes no further NCCL call on the communicator (owned or the caller's): the call in
 * progress fails at its next NCCL step with scapeInvalidUsage saying the NCCL communicator was
 * aborted.
 *
 * Deadlines (config timeoutMs, else SCAPE_TIMEOUT_MS): the host join and the broadcast and
 * all-reduce fail with scapeTimeout as the host collectives do; ncclCommInitRank, which waits
 * for every rank, runs on a helper thread (with the caller's device) and is waited for at most
 * the timeout: past it the call fails with scapeTimeout naming ncclCommInitRank, and the
 * helper thread is left to finish on its own (what it makes is released, never used).
 *
 * @param comm      out: the new communicator; must not be NULL. Set only on success.
 * @param nranks    number of ranks, >= 1.
 * @param uniqueId  the token from scapeGetUniqueId.
 * @param rank      this rank, 0 <= rank < nranks.
 * @param config    NULL or a configuration (as for scapeCommInitRankConfig).
 * @return scapeSuccess; scapeInvalidArgument (NULL comm, nranks < 1, rank out of range, a bad
 *         config or token); scapeUnsupported (NCCL cannot be loaded, or lacks one of the entry
 *         points above: the message names the library and why); scapeSystemError (not NCCL
 *         >= 2.10); the errors of scapeCommInitRankConfig for the host communicator; NCCL's
 *         errors from ncclGetUniqueId or ncclCommInitRank (the message names the call and
 *         gives NCCL's error string); scapeRemoteError on the ranks whose peer failed;
 *         scapeTimeout (above).
 */
SCAPE_API scapeResult_t scapeCommInitNcclRank(scapeComm_t* comm, int nranks, scapeUniqueId uniqueId,
                                              int rank, const scapeConfig_t* config);

/**
 * As scapeCommInitNcclRank, with rank, size and the rendezvous from the launcher's
 * environment, as scapeCommInitFromEnv reads them (torchrun, mpirun, srun). Set the CUDA
 * device first (torchrun: LOCAL_RANK).
 *
 * @param comm    out: the communicator; must not be NULL.
 * @param config  configuration, or NULL for defaults.
 * @return as scapeCommInitNcclRank; scapeInvalidUsage when no launcher environment is found
 *         (as scapeCommInitFromEnv).
 */
SCAPE_API scapeResult_t scapeCommInitNcclFromEnv(scapeComm_t* comm, const scapeConfig_t* config);

/** Writes the communicator's scapeBackend_t to *backend. */
SCAPE_API scapeResult_t scapeCommGetBackend(scapeComm_t comm, int* backend);

/** *cudaBuilt = 1 if this library was built with its CUDA kernels and device path;
 *  *deviceAvailable = 1 if a CUDA driver and device were found at run time. Thread-safe. */
SCAPE_API scapeResult_t scapeGetDeviceSupport(int* cudaBuilt, int* deviceAvailable);
/* ======================= END device (GPU data path, issue 13) ======================= */

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* SCAPE_SCAPE_H_ */
