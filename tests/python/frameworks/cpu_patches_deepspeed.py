"""CPU-only patch for DeepSpeed 0.16.4 on this machine (Debian's torch 1.13 CPU, gloo), applied
by the test harness through run_patched.py, never by scape.integrations.deepspeed or the example.

DeepSpeed picks its CPU accelerator by itself and falls back to gloo, but its torch backend
first tries to build (JIT, with a C++ compiler and ninja) the shared-memory all-reduce op
``deepspeed_shm_comm`` for intra-node CPU collectives, which is not built here
(DS_BUILD_OPS=0) and cannot be built in the test's time. Marking the op incompatible makes the
backend skip it; nothing of the gradient path uses it (the engine's gradient all-reduce is off
with ScapeAdamS, and the dense baseline's all-reduce goes through gloo). On a GPU cluster the
accelerator is CUDA, the backend NCCL, and the op is never looked at.
"""
import deepspeed.ops

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
