"""The processes of a run: DeepSpeed (``engine``, the only module that imports it), the process group
as plain torch sees it (``process_group``) and host-tensor collectives (``collectives``).
"""
