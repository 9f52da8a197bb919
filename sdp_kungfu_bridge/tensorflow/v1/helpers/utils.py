"""``kungfu.tensorflow.v1.helpers.utils``: human-readable sizes and rates (binary units).

``show_size(n)``: bytes as ``"1.50Gi"``/``"2.00Mi"``/``"3.00Ki"`` (two decimals, above 1 Ki)
or an integer; ``show_rate(n, seconds)``: ``"…B/s"``, ``"KiB/s"``, ``"MiB/s"`` or ``"GiB/s"``."""
Ki = 1024
Mi = Ki * Ki
Gi = Mi * Ki


def show_size(s):
    for unit, name in ((Gi, "Gi"), (Mi, "Mi"), (Ki, "Ki")):
        if s > unit:
            return "%.2f%s" % (float(s) / unit, name)
    return "%d" % s


def show_rate(size, duration):
    r = size / duration
    for unit, name in ((Gi, "GiB/s"), (Mi, "MiB/s"), (Ki, "KiB/s")):
        if r >= unit:
            return "%.2f%s" % (r / unit, name)
    return "%.2fB/s" % r
