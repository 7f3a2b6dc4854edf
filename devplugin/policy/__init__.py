"""Pure policy: data in, decisions out. The domain tree and levels (topology),
the exact device choice (allocator, with its compiled fold), placement from a
cluster record, a pod's shape (podinfo) and the CDI format. Nothing here
reads hardware, talks to a socket or imports anything of ours but `model`."""
