use super::*;

const PAGE: u64 = 4096;

#[test]
fn read_with_prps_encodes_every_byte() {
    let sqe = Sqe::read(
        0x1234,
        1,
        0x0000_0001_0000_0040,
        255,
        DataPtr::Prp {
            prp1: 0x1000_0000,
            prp2: 0x1000_1000,
        },
    );
    let b: [u8; 64] = bytemuck::cast(sqe);
    assert_eq!(b[0], 0x02, "opcode");
    assert_eq!(b[1], 0x00, "PSDT 00b, FUSE 00b");
    assert_eq!(&b[2..4], &0x1234u16.to_le_bytes(), "cid");
    assert_eq!(&b[4..8], &1u32.to_le_bytes(), "nsid");
    assert_eq!(&b[24..32], &0x1000_0000u64.to_le_bytes(), "prp1");
    assert_eq!(&b[32..40], &0x1000_1000u64.to_le_bytes(), "prp2");
    assert_eq!(&b[40..44], &0x40u32.to_le_bytes(), "cdw10 = SLBA low");
    assert_eq!(&b[44..48], &1u32.to_le_bytes(), "cdw11 = SLBA high");
    assert_eq!(&b[48..52], &255u32.to_le_bytes(), "cdw12 = NLB 0-based");
    assert_eq!(sqe.slba(), 0x0000_0001_0000_0040);
    assert_eq!(sqe.nlb(), 256);
    let back: Sqe = bytemuck::cast(b);
    assert_eq!(back, sqe);
    assert_eq!(
        back.data_ptr(),
        Some(DataPtr::Prp {
            prp1: 0x1000_0000,
            prp2: 0x1000_1000
        })
    );
}

#[test]
fn write_with_sgl_sets_psdt_and_descriptor_bytes() {
    let desc = SglDescriptor::data_block(0xdead_b000, 65536);
    let sqe = Sqe::write(7, 1, 4096, 127, DataPtr::Sgl(desc));
    let b: [u8; 64] = bytemuck::cast(sqe);
    assert_eq!(b[0], 0x01);
    // nvmetest.c's PSDT_SGL is 1 << 14 in CDW0: bit 6 of byte 1.
    assert_eq!(b[1], 0x40);
    assert_eq!(
        u32::from_le_bytes(b[0..4].try_into().unwrap()) & 0xc000,
        1 << 14
    );
    assert_eq!(sqe.psdt(), Psdt::SglMptrContiguous);
    let desc_bytes: [u8; 16] = bytemuck::cast(desc);
    assert_eq!(&b[24..40], &desc_bytes);
    assert_eq!(b[39], SGL_ID_DATA_BLOCK);
    assert_eq!(sqe.data_ptr(), Some(DataPtr::Sgl(desc)));

    let seg = SglDescriptor::last_segment(0x2000, 5);
    let mut sqe = Sqe::read(1, 1, 64, 31, DataPtr::Sgl(seg));
    let b: [u8; 64] = bytemuck::cast(sqe);
    assert_eq!(b[39], 0x30);
    assert_eq!(&b[32..36], &80u32.to_le_bytes(), "5 descriptors = 80 bytes");
    sqe.set_psdt(Psdt::Reserved);
    assert_eq!(sqe.flags, 0xc0);
    assert_eq!(sqe.data_ptr(), None);
    sqe.set_fuse(Fuse::First);
    assert_eq!(sqe.flags, 0xc1);
    assert_eq!(sqe.fuse(), Fuse::First);
    assert_eq!(sqe.psdt(), Psdt::Reserved);
    sqe.set_data_ptr(DataPtr::Prp { prp1: 1, prp2: 2 });
    assert_eq!(sqe.flags, 0x01, "PRP clears PSDT, keeps FUSE");
}

#[test]
fn admin_constructors_match_nvmetest() {
    let e = Sqe::identify(1, cns::CONTROLLER, 0, 0x4000);
    assert_eq!(
        (e.opcode, e.cdw10, e.dptr.prp1, e.nsid),
        (0x06, 1, 0x4000, 0)
    );
    let e = Sqe::identify(2, cns::NAMESPACE, 1, 0x4000);
    assert_eq!((e.cdw10, e.nsid), (0, 1));

    let e = Sqe::create_io_cq(3, 1, 256, 0x8000, None);
    assert_eq!((e.opcode, e.cdw10, e.cdw11), (0x05, (255 << 16) | 1, 1));
    assert_eq!(e.dptr.prp1, 0x8000);
    let e = Sqe::create_io_cq(3, 2, 64, 0x8000, Some(3));
    assert_eq!(e.cdw11, (3 << 16) | 0b11);

    let e = Sqe::create_io_sq(4, 1, 256, 0x9000, 1);
    assert_eq!((e.opcode, e.cdw10), (0x01, (255 << 16) | 1));
    assert_eq!(e.cdw11 >> 16, 1, "CQID");
    assert_eq!(e.cdw11 & 1, 1, "PC");

    let e = Sqe::delete_io_sq(5, 1);
    assert_eq!((e.opcode, e.cdw10), (0x00, 1));
    let e = Sqe::delete_io_cq(6, 1);
    assert_eq!((e.opcode, e.cdw10), (0x04, 1));

    let e = Sqe::set_features_num_queues(7, 4, 2);
    assert_eq!((e.opcode, e.cdw10, e.cdw11), (0x09, 0x07, (1 << 16) | 3));
    assert_eq!(allocated_queues(0x003f_003f), (64, 64));

    let e = Sqe::flush(8, 1);
    assert_eq!((e.opcode, e.nsid, e.cid, e.flags), (0x00, 1, 8, 0));
}

#[test]
fn cqe_status_field_and_phase() {
    let mut b = [0u8; 16];
    b[0..4].copy_from_slice(&0x003f_003fu32.to_le_bytes());
    b[8..10].copy_from_slice(&5u16.to_le_bytes());
    b[10..12].copy_from_slice(&1u16.to_le_bytes());
    b[12..14].copy_from_slice(&9u16.to_le_bytes());
    b[14..16].copy_from_slice(&((0x400fu16 << 1) | 1).to_le_bytes());
    let cqe: Cqe = bytemuck::cast(b);
    assert_eq!(
        (cqe.dw0, cqe.sq_head, cqe.sq_id, cqe.cid),
        (0x003f_003f, 5, 1, 9)
    );
    assert!(cqe.phase());
    assert_eq!(cqe.status().raw(), 0x400f);
    assert_eq!(
        Cqe::status_field(Status::from_raw(0x400f), true),
        cqe.status
    );
    let zero_phase = Cqe {
        status: Cqe::status_field(Status::SUCCESS, false),
        ..cqe
    };
    assert!(!zero_phase.phase());
    assert!(zero_phase.status().is_success());
}

#[test]
fn status_decodes_qemu_values() {
    let s = Status::from_raw(0x400f);
    assert_eq!(
        (s.sct(), s.sc(), s.dnr(), s.more()),
        (Sct::Generic, 0x0f, true, false)
    );
    assert!(s.is(Status::DATA_SGL_LENGTH_INVALID));
    assert_eq!(s.code(), 0x000f);
    assert_eq!(Status::DATA_SGL_LENGTH_INVALID.with_dnr(), s);
    assert_eq!(
        s.to_string(),
        "NVMe status 0x400f (generic: Data SGL Length Invalid)"
    );

    let s = Status::from_raw(0x4002);
    assert!(s.is(Status::INVALID_FIELD) && s.dnr());
    assert_eq!(
        s.to_string(),
        "NVMe status 0x4002 (generic: Invalid Field in Command)"
    );

    let s = Status::from_raw(0x0080);
    assert!(s.is(Status::LBA_OUT_OF_RANGE) && !s.dnr());
    assert_eq!(
        s.to_string(),
        "NVMe status 0x0080 (generic: LBA Out of Range)"
    );

    let s = Status::from_raw(0x400d);
    assert!(s.is(Status::INVALID_SGL_SEGMENT_DESCRIPTOR));
    assert!(Status::from_raw(0x4011).is(Status::SGL_DESCRIPTOR_TYPE_INVALID));
    assert!(Status::from_raw(0x000e).is(Status::INVALID_NUMBER_OF_SGL_DESCRIPTORS));
    assert!(Status::from_raw(0x0004).is(Status::DATA_TRANSFER_ERROR));
    assert!(Status::from_raw(0x0001).is(Status::INVALID_OPCODE));

    let s = Status::from_raw(0x4101);
    assert_eq!(s.sct(), Sct::CommandSpecific);
    assert!(s.is(Status::INVALID_QUEUE_IDENTIFIER));
    assert_eq!(
        s.to_string(),
        "NVMe status 0x4101 (command specific: Invalid Queue Identifier)"
    );
    assert_eq!(
        Status::from_raw(0x0281).to_string(),
        "NVMe status 0x0281 (media and data integrity: Unrecovered Read Error)"
    );
    assert_eq!(
        Status::from_raw(0x0123).to_string(),
        "NVMe status 0x0123 (command specific: status code 0x23)"
    );
    let s = Status::from_raw(0x3802 | STATUS_MORE);
    assert_eq!((s.crd(), s.more(), s.sc()), (3, true, 0x02));
    assert!(Status::SUCCESS.is_success());
    assert_eq!(
        Status::from_raw(0xffff).raw(),
        0x7fff,
        "bit 15 is not a status bit"
    );
}

#[test]
fn doorbell_offsets() {
    // DSTRD 0: 4-byte doorbells, SQ/CQ interleaved.
    assert_eq!(sq_tail_doorbell(0, 0), 0x1000);
    assert_eq!(cq_head_doorbell(0, 0), 0x1004);
    assert_eq!(sq_tail_doorbell(1, 0), 0x1008);
    assert_eq!(cq_head_doorbell(1, 0), 0x100c);
    assert_eq!(sq_tail_doorbell(64, 0), 0x1200);
    // DSTRD 2: 16-byte stride.
    assert_eq!(sq_tail_doorbell(0, 2), 0x1000);
    assert_eq!(cq_head_doorbell(0, 2), 0x1010);
    assert_eq!(sq_tail_doorbell(1, 2), 0x1020);
    assert_eq!(cq_head_doorbell(1, 2), 0x1030);
    assert_eq!(bar0_len_for_queues(1, 0), 0x1010);
}

#[test]
fn registers_decode_and_encode() {
    // QEMU 7.2-like: MQES 2047, CQR, TO 15 (7.5 s), DSTRD 0, CSS NVM,
    // MPSMIN 0 (4 KiB), MPSMAX 4 (64 KiB).
    let cap =
        Cap(2047 | cap::CQR | (15 << cap::TO_SHIFT) | cap::CSS_NVM | (4u64 << cap::MPSMAX_SHIFT));
    assert_eq!(cap.max_queue_entries(), 2048);
    assert!(cap.cqr() && cap.supports_nvm() && !cap.nssrs());
    assert_eq!(cap.timeout_ms(), 7500);
    assert_eq!(cap.dstrd(), 0);
    assert_eq!(cap.css(), 1);
    assert_eq!((cap.mpsmin_bytes(), cap.mpsmax_bytes()), (4096, 65536));
    assert_eq!(Cap(2u64 << cap::DSTRD_SHIFT).dstrd(), 2);

    // nvmetest.c's CC: EN | IOSQES 6 | IOCQES 4, MPS 0.
    let cc = Cc::nvm_enable(0);
    assert_eq!(cc.0, 0x0046_0001);
    assert!(cc.en());
    assert_eq!(
        (
            cc.css(),
            cc.page_bytes(),
            cc.ams(),
            cc.iosqes(),
            cc.iocqes()
        ),
        (0, 4096, 0, 6, 4)
    );
    let shut = cc.with_shn(Shn::Normal);
    assert_eq!(shut.0, 0x0046_4001);
    assert_eq!(shut.shn(), 1);
    assert!(!shut.with_en(false).en());
    assert_eq!(Cc::nvm_enable(4).page_bytes(), 65536);

    assert!(Csts(1).rdy() && !Csts(1).cfs());
    assert!(Csts(2).cfs());
    assert_eq!(Csts(0b1001).shst(), Shst::Complete);
    assert_eq!(Csts(0b0100).shst(), Shst::Occurring);
    assert_eq!(Csts(0).shst(), Shst::Normal);

    assert_eq!(aqa(32, 32), Some((31 << 16) | 31));
    assert_eq!(aqa(4096, 2), Some((1 << 16) | 4095));
    assert_eq!(aqa(1, 32), None);
    assert_eq!(aqa(32, 4097), None);

    let vs = Vs::new(1, 4, 0);
    assert_eq!(vs.0, 0x0001_0400);
    assert_eq!(vs.to_string(), "1.4.0");
}

fn put(d: &mut [u8], off: usize, bytes: &[u8]) {
    d[off..off + bytes.len()].copy_from_slice(bytes);
}

#[test]
fn identify_controller_parses_fields() {
    let mut d = [0u8; IDENTIFY_DATA_LEN];
    put(&mut d, idctl::VID, &0x1b36u16.to_le_bytes());
    put(&mut d, idctl::SSVID, &0x1af4u16.to_le_bytes());
    put(&mut d, idctl::SN, b"deadbeef            ");
    put(
        &mut d,
        idctl::MN,
        format!("{:<40}", "QEMU NVMe Ctrl").as_bytes(),
    );
    put(&mut d, idctl::FR, b"7.2.22  ");
    d[idctl::MDTS] = 7;
    put(&mut d, idctl::VER, &0x0001_0400u32.to_le_bytes());
    d[idctl::SQES] = 0x66;
    d[idctl::CQES] = 0x44;
    put(&mut d, idctl::NN, &256u32.to_le_bytes());
    d[idctl::VWC] = 1;
    put(&mut d, idctl::SGLS, &1u32.to_le_bytes());
    let id = IdentifyController::parse(&d);
    assert_eq!((id.vid, id.ssvid), (0x1b36, 0x1af4));
    assert_eq!(id.serial, "deadbeef");
    assert_eq!(id.model, "QEMU NVMe Ctrl");
    assert_eq!(id.firmware, "7.2.22");
    assert_eq!(id.mdts, 7);
    assert_eq!(id.max_transfer_bytes(4096), Some(512 * 1024));
    assert_eq!(id.ver.to_string(), "1.4.0");
    assert_eq!((id.sqe_bytes(), id.cqe_bytes()), (64, 16));
    assert_eq!(id.nn, 256);
    assert!(id.sgl_supported() && !id.sgl_dword_aligned() && !id.sgl_bit_bucket());
    assert!(id.volatile_write_cache());

    put(&mut d, idctl::SGLS, &0u32.to_le_bytes());
    d[idctl::MDTS] = 0;
    let id = IdentifyController::parse(&d);
    assert!(!id.sgl_supported());
    assert_eq!(id.max_transfer_bytes(4096), None);
    put(
        &mut d,
        idctl::SGLS,
        &(2u32 | sgls::BIT_BUCKET).to_le_bytes(),
    );
    let id = IdentifyController::parse(&d);
    assert!(id.sgl_supported() && id.sgl_dword_aligned() && id.sgl_bit_bucket());
    put(&mut d, idctl::SGLS, &3u32.to_le_bytes());
    assert!(
        !IdentifyController::parse(&d).sgl_supported(),
        "11b is reserved"
    );
}

#[test]
fn identify_namespace_parses_lba_format() {
    let mut d = [0u8; IDENTIFY_DATA_LEN];
    put(&mut d, idns::NSZE, &2_097_152u64.to_le_bytes());
    put(&mut d, idns::NCAP, &2_097_152u64.to_le_bytes());
    d[idns::NLBAF] = 1; // two formats
    d[idns::FLBAS] = 1;
    put(&mut d, idns::LBAF, &(9u32 << 16).to_le_bytes());
    put(&mut d, idns::LBAF + 4, &((12u32 << 16) | 8).to_le_bytes());
    let ns = IdentifyNamespace::parse(&d).unwrap();
    assert_eq!(ns.nsze, 2_097_152);
    assert_eq!(ns.lba_format_count, 2);
    assert_eq!(ns.lba_format_index, 1);
    assert_eq!((ns.lba_bytes, ns.metadata_bytes), (4096, 8));
    assert_eq!(ns.size_bytes(), 8 << 30);
    assert!(!ns.extended_lba);

    d[idns::FLBAS] = 0;
    assert_eq!(IdentifyNamespace::parse(&d).unwrap().lba_bytes, 512);
    d[idns::FLBAS] = 2;
    assert_eq!(
        IdentifyNamespace::parse(&d),
        Err(IdentifyError::FormatIndex { index: 2, count: 2 })
    );
    d[idns::FLBAS] = 0;
    put(&mut d, idns::LBAF, &0u32.to_le_bytes());
    let err = IdentifyNamespace::parse(&d).unwrap_err();
    assert_eq!(err, IdentifyError::LbaSize { index: 0, lbads: 0 });
    assert!(err.to_string().contains("LBADS 0"));
}

#[test]
fn sgl_descriptor_kinds() {
    let db = SglDescriptor::data_block(0x1000, 513);
    assert_eq!(db.sgl_type(), Some(SglType::DataBlock));
    let seg = SglDescriptor::segment(0x2000, 3);
    assert_eq!(
        (seg.sgl_id, seg.len, seg.sgl_type()),
        (0x20, 48, Some(SglType::Segment))
    );
    let last = SglDescriptor::last_segment(0x3000, 2);
    assert_eq!((last.sgl_id, last.len), (0x30, 32));
    assert_eq!(last.sgl_type(), Some(SglType::LastSegment));
    let bb = SglDescriptor::bit_bucket(4096);
    assert_eq!((bb.sgl_id, bb.sgl_type()), (0x10, Some(SglType::BitBucket)));
    assert_eq!(last.sgl_subtype(), SGL_SUBTYPE_ADDRESS);
    let bytes: [u8; 16] = bytemuck::cast(last);
    assert_eq!(&bytes[0..8], &0x3000u64.to_le_bytes());
    assert_eq!(&bytes[8..12], &32u32.to_le_bytes());
    assert_eq!(&bytes[12..16], &[0, 0, 0, 0x30]);
    let odd = SglDescriptor { sgl_id: 0x61, ..db };
    assert_eq!((odd.sgl_type(), odd.sgl_subtype()), (None, 1));
    assert_eq!(Dptr::from_sgl(last).sgl1(), last);
}

fn aligned(pages: u64) -> Extent {
    Extent {
        addr: 0x10_0000,
        len: pages * PAGE,
    }
}

#[test]
fn prp_one_and_two_pages_need_no_list() {
    let p = build_prps([aligned(1)], PAGE, &mut [], 0).unwrap();
    assert_eq!(
        (p.prp1, p.prp2, p.entries, p.list_slots),
        (0x10_0000, 0, 1, 0)
    );
    let p = build_prps([aligned(2)], PAGE, &mut [], 0).unwrap();
    assert_eq!((p.prp1, p.prp2, p.entries), (0x10_0000, 0x10_1000, 2));
    // 100 bytes inside a page: one entry, with the offset.
    let p = build_prps(
        [Extent {
            addr: 0x10_0f00,
            len: 0x100,
        }],
        PAGE,
        &mut [],
        0,
    )
    .unwrap();
    assert_eq!((p.prp1, p.prp2), (0x10_0f00, 0));
    // One page starting mid-page touches two pages.
    let p = build_prps(
        [Extent {
            addr: 0x10_0800,
            len: PAGE,
        }],
        PAGE,
        &mut [],
        0,
    )
    .unwrap();
    assert_eq!((p.prp1, p.prp2, p.entries), (0x10_0800, 0x10_1000, 2));
    assert_eq!(
        p.data_ptr(),
        DataPtr::Prp {
            prp1: 0x10_0800,
            prp2: 0x10_1000
        }
    );
    assert_eq!(prp_list_pages_needed(PAGE, PAGE), 0);
    assert_eq!(prp_list_pages_needed(2 * PAGE, PAGE), 0);
}

#[test]
fn prp_three_pages_use_a_list() {
    let mut list = vec![0u64; 512];
    let p = build_prps([aligned(3)], PAGE, &mut list, 0x80_0000).unwrap();
    assert_eq!(
        (p.prp1, p.prp2, p.entries, p.list_slots),
        (0x10_0000, 0x80_0000, 3, 2)
    );
    assert_eq!(&list[..2], &[0x10_1000, 0x10_2000]);
    assert_eq!(list[2], 0, "nothing written past the list");
    assert_eq!(prp_list_pages_needed(3 * PAGE, PAGE), 1);
}

#[test]
fn prp_513_pages_fill_one_list_page_514_chain() {
    // 513 pages: PRP1 + 512 list entries, exactly one full list page.
    assert_eq!(prp_list_pages_needed(513 * PAGE, PAGE), 1);
    let mut list = vec![0u64; 1024];
    let p = build_prps([aligned(513)], PAGE, &mut list, 0x80_0000).unwrap();
    assert_eq!((p.entries, p.list_slots), (513, 512));
    for (i, e) in list[..512].iter().enumerate() {
        assert_eq!(*e, 0x10_0000 + (i as u64 + 1) * PAGE);
    }
    assert_eq!(list[512], 0);
    // A list of exactly one page is enough for 513 pages.
    let mut one = vec![0u64; 512];
    build_prps([aligned(513)], PAGE, &mut one, 0x80_0000).unwrap();

    // 514 pages: 513 list entries; slot 511 chains to the second page.
    assert_eq!(prp_list_pages_needed(514 * PAGE, PAGE), 2);
    let mut list = vec![0u64; 1024];
    let p = build_prps([aligned(514)], PAGE, &mut list, 0x80_0000).unwrap();
    assert_eq!((p.entries, p.list_slots), (514, 514));
    assert_eq!(list[510], 0x10_0000 + 511 * PAGE);
    assert_eq!(list[511], 0x80_1000, "chain pointer to the next list page");
    assert_eq!(list[512], 0x10_0000 + 512 * PAGE);
    assert_eq!(list[513], 0x10_0000 + 513 * PAGE);
    let err = build_prps([aligned(514)], PAGE, &mut one, 0x80_0000).unwrap_err();
    assert_eq!(
        err,
        PrpError::ListTooSmall {
            entries: 513,
            pages: 2,
            page: PAGE,
            have: 512
        }
    );
    // Page counts: 511 usable entries per chained page.
    assert_eq!(prp_list_pages_for_entries(1 + 511 + 512, PAGE), 2);
    assert_eq!(prp_list_pages_for_entries(1 + 511 + 513, PAGE), 3);
}

#[test]
fn prp_scattered_page_aligned_extents() {
    let extents = [
        Extent {
            addr: 0x10_0800,
            len: 0x800,
        },
        Extent {
            addr: 0x20_0000,
            len: 2 * PAGE,
        },
        Extent {
            addr: 0x30_0000,
            len: 100,
        },
    ];
    assert_eq!(prp_entry_count(extents, PAGE), Ok(4));
    let mut list = vec![0u64; 512];
    let p = build_prps(extents, PAGE, &mut list, 0x80_0000).unwrap();
    assert_eq!(p.prp1, 0x10_0800);
    assert_eq!(&list[..3], &[0x20_0000, 0x20_1000, 0x30_0000]);
    // SGL descriptors (the P2P table's type) convert.
    let descs = [SglDescriptor::data_block(0x20_0000, 4096)];
    assert_eq!(prp_entry_count(descs.iter(), PAGE), Ok(1));
}

#[test]
fn prp_rejects_unaligned_middles() {
    let mid_start = [
        aligned(1),
        Extent {
            addr: 0x20_0010,
            len: PAGE,
        },
    ];
    assert_eq!(
        prp_entry_count(mid_start, PAGE),
        Err(PrpError::UnalignedStart {
            index: 1,
            addr: 0x20_0010,
            page: PAGE
        })
    );
    let mid_end = [
        Extent {
            addr: 0x10_0000,
            len: 1000,
        },
        Extent {
            addr: 0x20_0000,
            len: PAGE,
        },
    ];
    let err = prp_entry_count(mid_end, PAGE).unwrap_err();
    assert_eq!(
        err,
        PrpError::UnalignedEnd {
            index: 0,
            end: 0x10_03e8,
            page: PAGE
        }
    );
    assert!(err.to_string().contains("use an SGL"));
    assert_eq!(
        prp_entry_count(
            [Extent {
                addr: 0x10_0002,
                len: 8
            }],
            PAGE
        ),
        Err(PrpError::UnalignedFirst { addr: 0x10_0002 })
    );
    assert_eq!(
        prp_entry_count(Vec::<Extent>::new(), PAGE),
        Err(PrpError::Empty)
    );
    assert_eq!(
        prp_entry_count(
            [
                aligned(1),
                Extent {
                    addr: 0x20_0000,
                    len: 0
                }
            ],
            PAGE
        ),
        Err(PrpError::EmptyExtent { index: 1 })
    );
    assert_eq!(
        prp_entry_count([aligned(1)], 1000),
        Err(PrpError::PageSize(1000))
    );
    assert!(matches!(
        prp_entry_count(
            [Extent {
                addr: u64::MAX - 3,
                len: 8
            }],
            PAGE
        ),
        Err(PrpError::Overflow { .. })
    ));
    let mut list = vec![0u64; 512];
    assert_eq!(
        build_prps([aligned(3)], PAGE, &mut list, 0x80_0008),
        Err(PrpError::ListUnaligned {
            addr: 0x80_0008,
            page: PAGE
        })
    );
}

#[test]
fn prp_with_larger_pages() {
    let page = 65536;
    let ext = Extent {
        addr: 0x100_0000,
        len: 3 * page,
    };
    let mut list = vec![0u64; 8192];
    let p = build_prps([ext], page, &mut list, 0x200_0000).unwrap();
    assert_eq!(p.entries, 3);
    assert_eq!(&list[..2], &[0x101_0000, 0x102_0000]);
    assert_eq!(prp_list_pages_needed(8193 * page, page), 1);
    assert_eq!(prp_list_pages_needed(8194 * page, page), 2);
}

#[test]
fn constants_are_unique_and_named() {
    let c = nvme_constants();
    let mut names: Vec<&str> = c.iter().map(|(n, _)| n.as_str()).collect();
    names.sort_unstable();
    let before = names.len();
    names.dedup();
    assert_eq!(before, names.len(), "duplicate constant names");
    assert!(names.iter().all(|n| n.starts_with("KVTIER_NVME_")));
    assert!(nvme_layouts()
        .iter()
        .all(|(t, _, _)| t.starts_with("kvtier_nvme_")));
}
