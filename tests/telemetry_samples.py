"""npu-smi outputs in the layouts the Ascend driver prints (spacing and key names as on the cards),
for the telemetry parsers: an Atlas 800T A2 (910B3, one chip per NPU ID, HBM) and an Atlas 300I Duo
(310P3, two chips per NPU ID, no HBM: DDR only, power "NA" per chip on some driver versions)."""

NPU_910B_MAPPING = """\
        NPU ID                         Chip ID                        Chip Logic ID                  Chip Name
        0                              0                              0                              Ascend 910B3
        0                              1                              -                              Mcu
        1                              0                              1                              Ascend 910B3
        1                              1                              -                              Mcu
"""

NPU_910B_USAGES = """\
        NPU ID                         : 1
        Chip Count                     : 1

        DDR Capacity(MB)               : 0
        DDR Usage Rate(%)              : 0
        DDR Hugepages Total(page)      : 0
        DDR Hugepages Usage Rate(%)    : 0
        HBM Capacity(MB)               : 65536
        HBM Usage Rate(%)              : 53
        Aicore Usage Rate(%)           : 87
        Aivector Usage Rate(%)         : 41
        Aicpu Usage Rate(%)            : 0
        Ctrlcpu Usage Rate(%)          : 3
        DDR Bandwidth Usage Rate(%)    : 0
        HBM Bandwidth Usage Rate(%)    : 22
        Chip ID                        : 0
"""

NPU_910B_TEMP = """\
        NPU ID                         : 1
        Chip Count                     : 1

        NPU Temperature(C)             : 47
        Chip ID                        : 0
"""

NPU_910B_POWER = """\
        NPU ID                         : 1
        Chip Count                     : 1

        NPU Real-time Power(W)         : 283.6
        Chip ID                        : 0
"""

NPU_310P_MAPPING = """\
        NPU ID                         Chip ID                        Chip Logic ID                  Chip Name
        8                              0                              0                              Ascend 310P3
        8                              1                              1                              Ascend 310P3
        8                              2                              -                              Mcu
"""

NPU_310P_USAGES = """\
        NPU ID                         : 8
        Chip Count                     : 2

        DDR Capacity(MB)               : 44280
        DDR Usage Rate(%)              : 3
        DDR Hugepages Total(page)      : 22
        DDR Hugepages Usage Rate(%)    : 0
        Aicore Usage Rate(%)           : 0
        Aicpu Usage Rate(%)            : 0
        Ctrlcpu Usage Rate(%)          : 1
        Vectorcore Usage Rate(%)       : 0
        DDR Bandwidth Usage Rate(%)    : 0
        Chip ID                        : 0

        DDR Capacity(MB)               : 44280
        DDR Usage Rate(%)              : 25
        DDR Hugepages Total(page)      : 22
        DDR Hugepages Usage Rate(%)    : 0
        Aicore Usage Rate(%)           : 64
        Aicpu Usage Rate(%)            : 0
        Ctrlcpu Usage Rate(%)          : 2
        Vectorcore Usage Rate(%)       : 12
        DDR Bandwidth Usage Rate(%)    : 9
        Chip ID                        : 1
"""

NPU_310P_TEMP = """\
        NPU ID                         : 8
        Chip Count                     : 2

        Chip Temperature(C)            : 43
        Chip ID                        : 0

        Chip Temperature(C)            : 51
        Chip ID                        : 1
"""

NPU_310P_POWER = """\
        NPU ID                         : 8
        Chip Count                     : 2

        Power Dissipation(W)           : NA
        Chip ID                        : 0

        Power Dissipation(W)           : NA
        Chip ID                        : 1
"""
