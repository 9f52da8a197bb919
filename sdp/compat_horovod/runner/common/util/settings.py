"""``horovod.runner.common.util.settings`` on sdp: ``BaseSettings`` and ``Settings``, the plain
records of a launch's options (``num_proc``, ``verbose``, ``ssh_port``, ``ssh_identity_file``,
``extra_mpi_args``, ``tcp_flag``, ``binding_args``, ``key``, ``start_timeout``,
``output_filename``, ``run_func_mode``, ``nics``, ``elastic``, ``timestamp_output``; ``Settings``
adds ``hosts``, the ``"host:slots,..."`` string), with Horovod's defaults.  sdp's own launcher
(``sdprun``, :mod:`sdp.launcher.cli`) does not read them.  Mirrors Horovod's module.
"""


class BaseSettings:
    """The options of a launch, as attributes of the same names (see the module docstring)."""

    def __init__(self, num_proc=None, verbose=0, ssh_port=None, ssh_identity_file=None, extra_mpi_args=None,
                 tcp_flag=None, binding_args=None, key=None, start_timeout=None, output_filename=None,
                 run_func_mode=None, nics=None, elastic=False, timestamp_output=False):
        self.num_proc = num_proc
        self.verbose = verbose
        self.ssh_port = ssh_port
        self.ssh_identity_file = ssh_identity_file
        self.extra_mpi_args = extra_mpi_args
        self.tcp_flag = tcp_flag
        self.binding_args = binding_args
        self.key = key
        self.start_timeout = start_timeout
        self.output_filename = output_filename
        self.run_func_mode = run_func_mode
        self.nics = nics
        self.elastic = elastic
        self.timestamp_output = timestamp_output


class Settings(BaseSettings):
    """:class:`BaseSettings` plus ``hosts`` (``"host1:slots,host2:slots"``)."""

    def __init__(self, hosts=None, **kwargs):
        super().__init__(**kwargs)
        self.hosts = hosts
