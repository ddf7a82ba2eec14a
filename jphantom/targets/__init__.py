"""Descriptions of the accelerators :mod:`jphantom.costs.aot` compiles for: ``*.txtpb`` files, each a
``stream_executor.GpuTargetConfigProto`` in text form with its source in a comment (data only)."""
