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
 * - Collective calls are matched across ranks by their order: every rank of a communicator
 *   must issue the same collectives, in the same order, with the same count, datatype, op and
 *   root. A mismatch that reaches the wire is detected and reported on every rank
 *   (scapeRemoteError or scapeInvalidUsage); the communicator is then unusable (see "Errors").
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
 * different threads. scapeGetErrorString, scapeGetVersion and scapeGetUniqueId are
 * thread-safe.
 *
 * Memory
 * ------
 * All buffers are host memory owned by the caller. The library never keeps a pointer to a
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

/** Library version: SCAPE_VERSION_CODE == major * 10000 + minor * 100 + patch. */
#define SCAPE_MAJOR 0
#define SCAPE_MINOR 1
#define SCAPE_PATCH 0
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
  scapeNumTypes = 5
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
} scapeConfig_t;

#define SCAPE_CONFIG_MAGIC 0x5CA9Eu
#define SCAPE_CONFIG_INITIALIZER                                                     \
  {                                                                                  \
    sizeof(scapeConfig_t), SCAPE_CONFIG_MAGIC, SCAPE_VERSION_CODE,                   \
        SCAPE_CONFIG_UNDEF_INT, SCAPE_CONFIG_UNDEF_INT, NULL                         \
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
 *         scapeSystemError.
 */
SCAPE_API scapeResult_t scapeCommInitRank(scapeComm_t* comm, int nranks, scapeUniqueId uniqueId,
                                          int rank);

/** As scapeCommInitRank, with an explicit configuration (NULL means "all defaults").
 *  scapeInvalidArgument if config was not initialised with SCAPE_CONFIG_INITIALIZER or a field
 *  is out of range. */
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
 * communicator are incomplete; complete them or use scapeCommAbort. NULL is a no-op.
 */
SCAPE_API scapeResult_t scapeCommDestroy(scapeComm_t comm);

/**
 * Abandons a communicator at once, from any state: tells every peer (best effort, so that
 * their pending and next operations fail with scapeRemoteError instead of waiting for the
 * timeout), cancels pending requests, and frees everything, including request handles not yet
 * completed. NULL is a no-op.
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
 * - count: number of elements (not bytes). 0 is valid and completes without moving data
 *   (it still participates in ordering). Buffers may be NULL only when count is 0.
 * - dtype, op: see the enums; every rank must pass the same values.
 * - in place: pass the same pointer as sendbuf and recvbuf (all-reduce, broadcast), or
 *   sendbuf == recvbuf + rank * count (all-gather), or recvbuf == sendbuf + rank * recvcount
 *   (reduce-scatter). Any other overlap of send and receive buffers is invalid.
 * - stream: reserved for the CUDA / NCCL backend; must be NULL (scapeUnsupported otherwise).
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
 *              exchange (only masked positions move); this build returns scapeUnsupported
 *              for it until the mask API lands.
 * @return scapeSuccess; scapeInvalidArgument (NULL buffer with count > 0, bad dtype/op, bad
 *         overlap, NULL comm); scapeUnsupported (stream or mask non-NULL); scapeInvalidUsage
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
                                           scapeDataType_t dtype, scapeRedOp_t op,
                                           scapeComm_t comm, void* stream);
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
                                            scapeDataType_t dtype, scapeComm_t comm,
                                            void* stream, scapeRequest_t* request);

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

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* SCAPE_SCAPE_H_ */
