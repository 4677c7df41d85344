"""Fake registry packages for the data tests, built in memory: npm tarballs and Debian packages."""

import hashlib
import io
import lzma
import tarfile

PARAGRAPH = "It was the best of times, it was the worst of times; the age of wisdom and of foolishness.\n\n"


def make_npm_tarball(path, member_dir, files):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, text in files.items():
            data = text.encode("latin-1") if name.endswith("latin.txt") else text.encode("utf-8")
            info = tarfile.TarInfo(member_dir + name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    path.write_bytes(buf.getvalue())
    return hashlib.sha256(buf.getvalue()).hexdigest()


def make_deb(path, files: dict[str, bytes]):
    """A minimal .deb (an ar archive: debian-binary, control.tar.xz, data.tar.xz) holding ``files``; its sha256."""
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w:xz") as tar:
        for name, content in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
    members = [("debian-binary", b"2.0\n"), ("control.tar.xz", lzma.compress(b"")), ("data.tar.xz", data.getvalue())]
    out = bytearray(b"!<arch>\n")
    for name, body in members:
        header = f"{name + '/':<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(body):<10}`\n".encode()
        out += header + body + (b"\n" if len(body) % 2 else b"")
    path.write_bytes(bytes(out))
    return hashlib.sha256(bytes(out)).hexdigest()
