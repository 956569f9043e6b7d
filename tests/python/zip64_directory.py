"""Rewrites a zip archive's central directory in its ZIP64 form, as a writer does for archives
over 4 GiB: each entry's sizes and local-header offset become 0xFFFFFFFF with the real values in
a ZIP64 extra field (0x0001), and the end record's counts and offset become 0xFFFF / 0xFFFFFFFF
with the real ones in the ZIP64 end record. Member data is copied unchanged. Standard library
only. Usage: zip64_directory.py IN OUT"""
import struct
import sys
import zipfile


def main(src: str, dst: str) -> None:
    data = open(src, "rb").read()
    with zipfile.ZipFile(src) as archive:
        infos = archive.infolist()
    # The members' local headers and data: everything before the first directory entry.
    directory_at = data.find(b"PK\x01\x02")
    out = bytearray(data[:directory_at])
    directory = bytearray()
    for info in infos:
        name = info.filename.encode()
        extra = struct.pack("<HHQQQ", 0x0001, 24, info.file_size, info.compress_size, info.header_offset)
        directory += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 45, 45, info.flag_bits, info.compress_type,
                                 0, 0, info.CRC, 0xFFFFFFFF, 0xFFFFFFFF, len(name), len(extra), 0, 0, 0, 0,
                                 0xFFFFFFFF)
        directory += name + extra
    offset = len(out)
    out += directory
    record_at = len(out)
    out += struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, len(infos), len(infos), len(directory), offset)
    out += struct.pack("<IIQI", 0x07064B50, 0, record_at, 1)
    out += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
    open(dst, "wb").write(out)
    with zipfile.ZipFile(dst) as check:  # Python's reader agrees it is a valid archive
        assert check.testzip() is None, "rewritten archive fails its CRC check"


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
