//! `embed_migrations!` reads `../migrations` at compile time, and cargo watches only the files of
//! this package: without this, a new migration would not rebuild the crate, and a binary built
//! after adding one would ship without it.
fn main() {
    println!("cargo:rerun-if-changed=../migrations");
}
