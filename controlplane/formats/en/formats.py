"""One way to write a moment on every page: ISO 8601 order, UTC (TIME_ZONE), to
the second; the pages' scripts write the API's times the same way (Gantry.when).
Django's English locale would otherwise write "Nov. 28, 2026, 2:05 a.m."."""

DATETIME_FORMAT = "Y-m-d H:i:s"
SHORT_DATETIME_FORMAT = "Y-m-d H:i"
DATE_FORMAT = "Y-m-d"
SHORT_DATE_FORMAT = "Y-m-d"
TIME_FORMAT = "H:i:s"
