"""Throughput measurement, guarded against the errors a tokens/s figure is open to.

A cold page cache times the storage, shared cores time the scheduler, an untied head
left in bf16 or a stale compile cache times another build than the one reported, and a
single pass is an anecdote (docs/measurement.md tells how these came to light). Each
module here makes one of those errors loud:

    contention   refuse to time on cores something else is using
    residency    read the model into the page cache and prove it stayed there
    bandwidth    the memory bandwidth that bounds decode speed (the roofline)
    passes       paired, order-rotated passes with their spread; never one pass
    provenance   the host, versions and settings a number was measured under
    hostprobe    which 4-bit runtimes this CPU can run at all, and why not

and the rest is what a bench job is planned with:

    pinning        the job's cores, chosen once; every thread of the process on them
    weight_bytes   the weight bytes a decode step reads (the roofline's) and an engine holds
    hostmemory     how much memory the job may still allocate (its cgroup's limit included)
    memory_groups  which engines held open for the job fit in memory together
"""
